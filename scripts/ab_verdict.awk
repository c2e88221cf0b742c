# The verdict of an A/B/B/A comparison, shared by scripts/gpu_ab.sh (times: lower is
# better) and scripts/e2e_ab.sh (throughput: higher is better). Load it with `awk -f
# scripts/ab_verdict.awk -f PROGRAM` (mawk has no -e).
# ab_verdict(a1, b1, b2, a2, higher_is_better, better, worse): `better` or `worse` (with
# B's change against A in per cent) only when every B run is beyond every A run by more
# than the larger spread of two runs of the same code (|A1 - A2|, |B1 - B2|), else
# "within spread". A gap equal to the spread (up to rounding) is not beyond it.
function ab_abs(x) { return x < 0 ? -x : x }
function ab_verdict(a1, b1, b2, a2, higher_is_better, better, worse,
                    spread, change, amin, amax, bmin, bmax, up) {
  spread = ab_abs(a1 - a2); if (ab_abs(b1 - b2) > spread) spread = ab_abs(b1 - b2)
  spread += 1e-9
  change = a1 + a2 > 0 ? sprintf(" (%+.1f%%)", 100 * ((b1 + b2) / (a1 + a2) - 1)) : ""
  amin = a1 < a2 ? a1 : a2; amax = a1 > a2 ? a1 : a2
  bmin = b1 < b2 ? b1 : b2; bmax = b1 > b2 ? b1 : b2
  if (bmin - amax > spread) return (higher_is_better ? better : worse) change
  if (amin - bmax > spread) return (higher_is_better ? worse : better) change
  return "within spread"
}
