"""The autotune loop: `python run.py -m +experiment=autotune [overrides]` finds the fastest setting
it can prove, by following the runs' own verdicts.

From the user's configuration (the base), in rounds:

0. the base runs once; its verdict (`accelexp.diagnosis.verdict`, the tag
   `record.DIAGNOSIS_ADVICE`) names the overrides to try next (a contended verdict: what a
   compute-bound run is advised, the rules before it having not fired);
1. each override not yet rejected on this base that changes no frozen key (`autotune.freeze`)
   and composes becomes a **candidate**; the base and the candidates run `repeats` times,
   round-robin (base, A, B, then B, A, base, ...: every other round backwards, so that a drift
   within a round falls on each alike), each round of them under its own `repeat_index`, so that
   repeat i of a candidate pairs with repeat i of the base (`accelexp.report.compare.ratio`: a
   paired t interval of the log ratios, as the report computes every speedup);
2. a candidate is **kept** when its speedup's 95 % interval lies wholly above 1.0 and its test
   accuracy (the mean over its repeats, after the same number of steps: the accuracy proxy) is
   at most `autotune.accuracy_tolerance` below the base's; else **rejected**, with why (slower, no
   measurable difference, too few measured runs, failed, less accurate). The pairs are those
   timed on a quiet machine where `MIN_QUIET_PAIRS` (3) or more were; else (a VM whose
   hypervisor always steals a share, a busy host) every pair, and the why says so: the pairs
   were interleaved, so what both runs of a pair shared cancels, and what they did not widens
   the interval;
3. the kept candidate with the largest speedup joins the base: the new best, whose own verdict
   (from its candidate runs) is asked again — back to 1 — until no candidate is kept, none is
   left to try, or the budget is spent (`autotune.budget_s`: no trial run starts after it;
   `autotune.max_trials`: runs in all). Any candidate, kept or rejected, is tried again on the
   new best where that one's verdict offers it: on another base it is another question (bf16
   on one process, bf16 on two DDP workers); on the same base never twice.

Every trial is an ordinary run, a child of the sweep's parent; the loop tags each (`record.
AUTOTUNE_*`): its round, its role (base | candidate), the candidate, and on a candidate's runs the
decision, why and the base's `setting_id` — by which later verdicts of that setting on this host
leave a rejected override out (`Tracker.rejected_by_autotune`). The path — each step with its
gain and interval, each rejection and why, the line to paste — is `AutotunePath`, written by
`accelexp.autotune.path`.

`loop.py` knows runs as `RunRecord`s and overrides as text; the Hydra sweeper
(`hydra_plugins.accelexp_sweeper.AutotuneSweeper`) gives it a way to run a batch of jobs, and
`accelexp.tracking` the store.
"""

from accelexp.autotune.loop import Autotune, AutotunePath, Candidate, Step, decide, merged

__all__ = ["Autotune", "AutotunePath", "Candidate", "Step", "decide", "merged"]
