#!/usr/bin/env bash
# Static checks of deploy/ (Docker and a cluster are not needed):
#  - every Kubernetes YAML parses, and the kustomizations render (when kubectl exists);
#  - promtool accepts the Prometheus config and alert rules;
#  - every Grafana panel query is valid PromQL (fed to promtool as recording rules)
#    and the dashboard covers every metric of the contract;
#  - the Dockerfile's build packages are those of scripts/install_deps.sh.
set -euo pipefail
cd "$(dirname "$0")"

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

promtool check config prometheus/prometheus.yml
promtool check rules prometheus/alerts.yml

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp/dashboard_rules.yml" <<'PY'
import json, sys, yaml
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
            'sds_cache_pages', "sds_queue_depth"]
missing = [m for m in required if m not in text]
assert not missing, f"dashboard lacks panels for {missing}"
assert 'state="used"' in text and "used|free" in text, "cache panels must show used and free"
print(f"dashboard ok: {len(exprs)} queries cover {len(required)} metrics")
PY
promtool check rules "$tmp/dashboard_rules.yml" >/dev/null
echo "dashboard PromQL ok"

# Build packages: the Dockerfile's apt list must equal install_deps.sh's minus the
# developer-only tools.
dev_only="prometheus gnuplot-nox curl clang-format clang-tidy python3-pip"
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
