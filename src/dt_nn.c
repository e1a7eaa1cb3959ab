/* dt_nn.c */
#include "dt_internal.h"
