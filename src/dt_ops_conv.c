/* dt_ops_conv.c */
#include "dt_internal.h"
