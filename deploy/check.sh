#!/usr/bin/env bash
# Static checks of deploy/ (Docker and a cluster are not needed):
#  - every Kubernetes YAML parses, and the kustomizations render (when kubectl exists);
#  - the CPU Deployment sizes its thread pool (--cpu_threads) to its CPU request;
#  - every Grafana panel query is valid PromQL (fed to promtool as recording rules),
#    the dashboard covers every metric of the contract, and its error ratio counts
#    the codes the SdsErrorsHigh alert counts;
#  - the Dockerfile's build packages are those of scripts/install_deps.sh;
#  - promtool accepts the Prometheus config and alert rules, and the alerts' unit
#    tests (prometheus/alerts_test.yml) pass.
# Run by ctest as `deploy_check`. Without promtool (or with PROMTOOL set empty) the
# checks that need no promtool still run, then it exits 77, which ctest reports as
# skipped (SKIP_RETURN_CODE).
set -euo pipefail
cd "$(dirname "$0")"

if [[ -v PROMTOOL ]]; then
  promtool=$PROMTOOL
else
  promtool=$(command -v promtool || true)
fi

python3 - <<'PY'
import glob, yaml
for path in sorted(glob.glob("k8s/**/*.yaml", recursive=True) + glob.glob("grafana/provisioning/*.yaml")) + ["prometheus/prometheus-k8s-sd.yml"]:
    docs = [d for d in yaml.safe_load_all(open(path)) if d is not None]
    assert docs, f"{path}: empty"
    print(f"yaml ok: {path} ({len(docs)} documents)")
PY

if command -v kubectl >/dev/null; then
  for k in k8s/base k8s/overlays/gpu; do
    kubectl kustomize "$k" >/dev/null
    echo "kustomize ok: $k"
  done
fi

# The CPU backend's pool defaults to hardware_concurrency(), the node's CPUs, not the
# pod's: a CPU Deployment must pass --cpu_threads equal to its CPU request.
python3 - <<'PY'
import glob, re, sys, yaml

def cpus(quantity):
    q = str(quantity)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)

checked = 0
for path in sorted(glob.glob("k8s/**/*.yaml", recursive=True)):
    for doc in yaml.safe_load_all(open(path)):
        if not doc or doc.get("kind") != "Deployment":
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            args = c.get("args") or []
            if "--backend=cpu" not in args:
                continue
            threads = [a.split("=", 1)[1] for a in args if a.startswith("--cpu_threads=")]
            request = ((c.get("resources") or {}).get("requests") or {}).get("cpu")
            where = f"{path}: container {c['name']}"
            if not threads:
                sys.exit(f"{where}: --backend=cpu without --cpu_threads (0 = the pod's CPU limit, or every core of the node without one)")
            if request is None:
                sys.exit(f"{where}: --cpu_threads={threads[-1]} but no CPU request to match")
            if int(threads[-1]) != cpus(request):
                sys.exit(f"{where}: --cpu_threads={threads[-1]} differs from the CPU request {request}")
            print(f"cpu threads ok: {where}: --cpu_threads={threads[-1]}, request {request}")
            checked += 1
assert checked, "no CPU Deployment found (expected k8s/base/deployment.yaml)"
PY

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp/dashboard_rules.yml" <<'PY'
import json, re, sys, yaml
dash = json.load(open("grafana/sparse-decode-server.json"))
exprs = []
for panel in dash["panels"]:
    for t in panel.get("targets", []):
        exprs.append((panel["title"], t["expr"]))
rules = [{"record": f"dashboard:panel_{i}", "expr": e.replace("$__rate_interval", "5m").replace("$instance", ".*")}
         for i, (_, e) in enumerate(exprs)]
yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, open(sys.argv[1], "w"))
text = " ".join(e for _, e in exprs)
required = ["sds_batch_size", "sds_batch_queue_seconds", "sds_batch_compute_seconds",
            "sds_batch_total_seconds", "sds_requests_total", "sds_request_latency_seconds",
            "sds_cache_pages", "sds_cache_pages_capacity", "sds_queue_depth",
            "sds_stream_answer_send_seconds"]
missing = [m for m in required if not re.search(rf"\b{m}(_bucket|_sum|_count)?\b", text)]
assert not missing, f"dashboard lacks panels for {missing}"
assert 'state="used"' in text, "cache panels must show used pages"
assert 'state="total"' not in text, 'sds_cache_pages has no state="total": use sds_cache_pages_capacity'

# The overview's error ratio and the SdsErrorsHigh alert count the same codes as errors.
alerts = yaml.safe_load(open("prometheus/alerts.yml"))
rule = next(r for g in alerts["groups"] for r in g["rules"] if r.get("alert") == "SdsErrorsHigh")
want = re.findall(r'code!~"([^"]*)"', rule["expr"])
assert len(want) == 1, f"SdsErrorsHigh: expected one code!~ matcher, found {want}"
ratio = [e for title, e in exprs if title == "Error ratio"]
assert len(ratio) == 1, "dashboard: expected one 'Error ratio' query"
have = re.findall(r'code!~?"([^"]*)"', ratio[0])
assert have == want, f"dashboard 'Error ratio' excludes {have}, SdsErrorsHigh excludes {want}"
print(f"dashboard ok: {len(exprs)} queries cover {len(required)} metrics; error ratio excludes {want[0]}")
PY

# Build packages: the Dockerfile's apt list must equal install_deps.sh's minus the
# developer-only tools.
dev_only="prometheus gnuplot-nox curl clang-format clang-tidy python3-pip python3-venv python3-yaml"
want=$(sed -n '/^DEB_PACKAGES=(/,/^)/p' ../scripts/install_deps.sh | sed '1d;$d' | tr -s ' \n' '\n' \
  | grep -v '^$' | grep -vxF -f <(tr ' ' '\n' <<<"$dev_only") | sort)
have=$(sed -n '/apt-get install/,/rm -rf/p' Dockerfile | grep -v 'apt-get\|rm -rf' | tr -d '\\' \
  | tr -s ' \n' '\n' | grep -v '^$' | sort)
if [[ "$want" != "$have" ]]; then
  echo "Dockerfile packages differ from scripts/install_deps.sh:" >&2
  diff <(echo "$want") <(echo "$have") >&2 || true
  exit 1
fi
echo "Dockerfile packages match scripts/install_deps.sh"

if [[ -z "$promtool" ]]; then
  echo "SKIP: promtool not found (PROMTOOL empty or not on PATH): Prometheus config, alert rules," \
    "alert unit tests and dashboard PromQL not checked"
  exit 77
fi
"$promtool" check config prometheus/prometheus.yml
"$promtool" check rules prometheus/alerts.yml
"$promtool" test rules prometheus/alerts_test.yml
"$promtool" check rules "$tmp/dashboard_rules.yml" >/dev/null
echo "dashboard PromQL ok"
echo "deploy/check.sh: all checks passed"
