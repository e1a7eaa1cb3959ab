/* dt_optim.c */
#include "dt_internal.h"
