/* The planner's fluid of a parameter-server round (dt__plan_ps_fluid, the
 * library's private function: linked with the library object, Makefile's LINKED_TESTS)
 * and its probe's rate of one transfer (dt__plan_probe_rate, at the end)
 * against cases worked out by hand: one worker; workers in step for good
 * (no update time, no compute); two workers whose updates shift them by u a
 * round (4d - u, below); an update-bound server; ports wide enough for
 * every transfer (M servers, or a link per connection); and its refusals. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#define CHECK_REL(a, b, rel)                                                                              \
  CHECK_MSG(fabs((double)(a) - (double)(b)) <= (rel) * fabs((double)(b)) + 1e-15, "%.12g, want %.12g", \
            (double)(a), (double)(b))

static void test_fluid_by_hand(void) {
  /* one worker: its own path, compute + push + update + pull */
  CHECK_REL(dt__plan_ps_fluid(1, 2.16e-3, 0.01, 0.02, 1e-4, 1), 2.16e-3 + 0.03 + 1e-4, 1e-12);
  /* no update time and no compute: 4 workers push together (4 x d_in), then pull together
   * (4 x d_out), for ever */
  CHECK_REL(dt__plan_ps_fluid(4, 0, 1, 2, 0, 1), 4 * (1 + 2), 1e-12);
  /* two workers, d = 1 each way, update u = 0.1, no compute. Both push at half rate (done
   * at 2); A's update ends at 2.1 and its pull runs alone for u, then shares with B's;
   * A has its pull at 4, B at 4.1, so A pushes alone for u and they share again: A's
   * push ends at 6 - u, B's at 6, A's update at 6, B's at 6.1: the pair has moved by
   * 4d - u = 3.9 since the first updates, and so on every round */
  CHECK_REL(dt__plan_ps_fluid(2, 0, 1, 1, 0.1, 1), 3.9, 1e-9);
  /* the server's updates bound the round: 4 x 0.1 */
  CHECK_REL(dt__plan_ps_fluid(4, 2.16e-3, 0.01, 0.01, 0.1, 1), 0.4, 1e-9);
  /* ports as wide as the transfers (2 servers for 2 workers; a link per connection):
   * nobody shares, the path alone (0.5 + 1 + 0.1 + 1), or the updates (4 x 0.9) */
  CHECK_REL(dt__plan_ps_fluid(2, 0.5, 1, 1, 0.1, 2), 2.6, 1e-9);
  CHECK_REL(dt__plan_ps_fluid(4, 2.16e-3, 0.01, 0.01, 1e-4, 4), 2.16e-3 + 0.02 + 1e-4, 1e-9);
  CHECK_REL(dt__plan_ps_fluid(4, 0.5, 1, 1, 0.9, 4), 3.6, 1e-9);
  /* M servers each take 1/M of a push: as one port M links wide, each flow at most its
   * worker's link: 8 workers, 8 servers, no sharing past the worker's own link */
  CHECK_REL(dt__plan_ps_fluid(8, 0.2, 0.75, 0.75, 0.005, 8), 0.2 + 1.5 + 0.005, 1e-9);
  /* between the bounds: at least the ports' busy time and the path, at most in step */
  double r = dt__plan_ps_fluid(16, 0.2, 0.75, 0.75, 0.045, 1);
  CHECK(r >= 16 * 0.75 && r <= 16 * 1.5 + 0.2 + 16 * 0.045);
  /* not modelled: no workers, too many, no port */
  CHECK(dt__plan_ps_fluid(0, 1, 1, 1, 1, 1) == 0.0);
  CHECK(dt__plan_ps_fluid(1025, 1, 1, 1, 1, 1) == 0.0); /* (past DT__PLAN_FLUID_MAX) */
  CHECK(dt__plan_ps_fluid(2, 1, 1, 1, 1, 0) == 0.0);
}

/* The probe's rate from one transfer (dt__plan_probe_rate): 16 MB in 4 ms, of
 * which the ack's round trip 10 us. */
static void test_probe_rate_by_hand(void) {
  const double B = 16e6, t = 4e-3, rt = 1e-5;
  /* a wire: the ends' CPU idle most of the time, the wall-clock rate */
  CHECK_REL(dt__plan_probe_rate(B, t, rt, 0.2e-3, 0.3e-3), B / (t - rt), 1e-12);
  /* copies on two cores at once: each end busy all along, B / t either way */
  CHECK_REL(dt__plan_probe_rate(B, t, rt, 3.9e-3, 4.0e-3), 2 * B / 7.9e-3, 1e-12);
  /* the two ends on one core, one copy after the other: each copy's rate, twice the
   * wall-clock one, what two cores give */
  CHECK_REL(dt__plan_probe_rate(B, t, rt, 2.0e-3, 1.9e-3), 2 * B / 3.9e-3, 1e-12);
  /* one end busy all along, the other not (a sender spinning while a wire drains; a peer
   * that says 0): not copies, the wall-clock rate */
  CHECK_REL(dt__plan_probe_rate(B, t, rt, 4.0e-3, 0.4e-3), B / (t - rt), 1e-12);
  CHECK_REL(dt__plan_probe_rate(B, t, rt, 3.5e-3, 0), B / (t - rt), 1e-12);
  /* the CPU times unknown (-1) or not believable (the peer's word past the transfer's
   * time, negative, NaN): the wall-clock rate */
  CHECK_REL(dt__plan_probe_rate(B, t, rt, -1, 1.9e-3), B / (t - rt), 1e-12);
  CHECK_REL(dt__plan_probe_rate(B, t, rt, 2.0e-3, -1), B / (t - rt), 1e-12);
  CHECK_REL(dt__plan_probe_rate(B, t, rt, 2.0e-3, 1.0), B / (t - rt), 1e-12);
  CHECK_REL(dt__plan_probe_rate(B, t, rt, 2.0e-3, NAN), B / (t - rt), 1e-12);
  /* a round trip as long as the transfer (a tiny one): the whole time */
  CHECK_REL(dt__plan_probe_rate(B, t, t, 0, 0), B / t, 1e-12);
}

int main(void) {
  TH_RUN(test_fluid_by_hand);
  TH_RUN(test_probe_rate_by_hand);
  return th_summary("plan_fluid");
}
