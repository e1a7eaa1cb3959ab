/* The one translation unit of the test suite that holds the implementation. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
