#!/usr/bin/env bash
# Host discovery for an elastic job on Kubernetes (launch/launch.py
# --host-discovery-script launch/discovery/k8s_pods.sh), run in the launcher's pod: one
# `host:slots` line per worker pod that is Running and Ready, named by its IP, with
# DM_SLOTS_PER_POD slots (default 1). Pods are chosen by the label DM_WORKER_SELECTOR
# (default app=dist-minimize-worker) in the namespace DM_NAMESPACE (default: this pod's).
# A pod evicted or preempted leaves the list; a new one joins it, and the job grows.
set -euo pipefail
slots=${DM_SLOTS_PER_POD:-1}
selector=${DM_WORKER_SELECTOR:-app=dist-minimize-worker}
namespace=${DM_NAMESPACE:-$(cat /var/run/secrets/kubernetes.io/serviceaccount/namespace 2>/dev/null || echo default)}
kubectl get pods --namespace "$namespace" --selector "$selector" --field-selector=status.phase=Running \
  --output 'jsonpath={range .items[*]}{.status.podIP}{" "}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' \
  | awk -v slots="$slots" '$1 != "" && $2 == "True" {print $1 ":" slots}'
