/* dt_ops_nn.c */
#include "dt_internal.h"
