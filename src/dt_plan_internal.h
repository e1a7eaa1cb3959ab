/* ===========================================================================
 * dt_plan_internal.h -- the planner's models, for its own tests (plan layer)
 * ===========================================================================
 * Private: part of the implementation, not of the API. See dt_internal.h.
 * Declared here (not static in dt_plan.c) so that tests/test_plan_fluid.c
 * links with the library object instead of compiling the implementation.
 */
#ifndef DTRAIN_PLAN_INTERNAL_H
#define DTRAIN_PLAN_INTERNAL_H

#include "dt_internal.h"

/* The seconds of one worker's round of n asynchronous workers against the
 * parameter servers: the fluid model described at its definition (dt_plan.c);
 * 0 where it is not modelled (n outside 1..1024, cap not > 0). */
DTRAIN_PRIVATE double dt__plan_ps_fluid(int n, double z, double d_in, double d_out, double u, double cap);

/* The rate (bytes/s) dt_plan_probe_link takes from one transfer of `bytes`
 * that took t seconds, rt of them the acknowledgement's round trip, and
 * cpu_a and cpu_b seconds of the sender's and the receiver's CPU (< 0:
 * unknown): bytes / (t - rt), unless each CPU time is at least 1/4 of t and
 * the two account for at least 3/4 of it (the copies bound it, not a wire):
 * then 2 x bytes / (cpu_a + cpu_b), the rate of one end's copy, wherever
 * the two ends ran. */
DTRAIN_PRIVATE double dt__plan_probe_rate(double bytes, double t, double rt, double cpu_a, double cpu_b);

#endif
