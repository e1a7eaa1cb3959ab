/* dt_ops_reduce.c */
#include "dt_internal.h"
