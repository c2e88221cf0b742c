#!/usr/bin/env python3
"""Sums an Nsight Compute source-page export over its launches and says where the warps wait.

Input: the CSV of `ncu -i REPORT.ncu-rep --page source --print-source sass --csv` for a
report of one kernel (several launches are summed: each launch is a block that starts
with a "Kernel Name" line). Profile with warp sampling, e.g.
  ncu --clock-control none --set full --import-source no --warp-sampling-interval 0 \\
      -k regex:^SparseDecodeKernel --launch-skip 5 --launch-count 5 -o P \\
      sds_gpu_bench --case b1_k512_128k --iters 10
Output: the total warp samples, the stall reasons' shares, the instructions with the
most samples (offset from the kernel's first instruction, executions, SASS, top stall
reasons) and, with --split OFF[,OFF...], the samples of each offset range (e.g. before,
in and after a main loop: find the loop's offsets in the listing). Exits 1 when the
export holds no samples (an empty or failed profile must not read as "nothing waits").

  scripts/ncu_source_summary.py EXPORT.csv [--top N] [--split 0x34f0,0x4d20]
"""
import argparse
import csv
import sys
from collections import OrderedDict


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_blocks(path):
    """The export's blocks (one per launch), each a list of CSV rows without its name line."""
    blocks, current = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                current = []
                blocks.append(current)
            elif current is not None and row:
                current.append(row)
    return blocks


def summarise(blocks):
    """Per instruction address: SASS, samples, executions and samples per stall reason."""
    per_address = OrderedDict()
    reasons = []
    for rows in blocks:
        if not rows:
            continue
        header, body = rows[0], rows[1:]
        column = {name: i for i, name in enumerate(header)}
        for needed in ("Address", "Source", "Warp Stall Sampling (All Samples)"):
            if needed not in column:
                raise ValueError(f"column '{needed}' missing: not a --page source export?")
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        for row in body:
            if len(row) < len(header):
                continue
            entry = per_address.setdefault(
                int(row[column["Address"]], 16),
                {"sass": row[column["Source"]].strip(), "samples": 0.0, "executed": 0.0,
                 "stalls": {r: 0.0 for r in reasons}})
            entry["samples"] += number(row[column["Warp Stall Sampling (All Samples)"]])
            if "Instructions Executed" in column:
                entry["executed"] += number(row[column["Instructions Executed"]])
            for r in reasons:
                entry["stalls"][r] = entry["stalls"].get(r, 0.0) + number(row[column[r]])
    return per_address, reasons


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--split", default="", help="offsets (hex) that end each range")
    args = parser.parse_args()

    blocks = read_blocks(args.export)
    per_address, reasons = summarise(blocks)
    total = sum(e["samples"] for e in per_address.values())
    if total <= 0:
        print(f"ncu_source_summary: no warp samples in {args.export} "
              f"({len(blocks)} launch blocks)", file=sys.stderr)
        return 1
    base = min(per_address)
    print(f"{len(blocks)} launches, {len(per_address)} instructions, {total:.0f} warp samples")

    print("\nstall reasons:")
    by_reason = {r: sum(e["stalls"].get(r, 0.0) for e in per_address.values()) for r in reasons}
    for r, v in sorted(by_reason.items(), key=lambda kv: -kv[1]):
        if v > 0:
            print(f"  {r[len('stall_'):]:20} {v:9.0f} {100 * v / total:5.1f} %")

    if args.split:
        ends = [int(x, 16) for x in args.split.split(",")] + [None]
        print("\nranges (offsets from the kernel's first instruction):")
        start = 0
        for end in ends:
            s = sum(e["samples"] for a, e in per_address.items()
                    if a - base >= start and (end is None or a - base < end))
            label = f"[{start:#x}, {'end' if end is None else hex(end)})"
            print(f"  {label:20} {s:9.0f} {100 * s / total:5.1f} %")
            start = end if end is not None else start

    print(f"\ntop {args.top} instructions: offset, samples, executions, SASS, top stall reasons")
    ranked = sorted(per_address.items(), key=lambda kv: -kv[1]["samples"])[:args.top]
    for address, e in ranked:
        top = sorted(e["stalls"].items(), key=lambda kv: -kv[1])[:3]
        why = " ".join(f"{r[len('stall_'):]}={v:.0f}" for r, v in top if v > 0)
        print(f"  {address - base:#07x} {e['samples']:7.0f} {e['executed']:8.0f}  "
              f"{e['sass'][:56]:56} {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
