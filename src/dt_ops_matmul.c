/* dt_ops_matmul.c */
#include "dt_internal.h"
