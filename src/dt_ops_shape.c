/* dt_ops_shape.c */
#include "dt_internal.h"
