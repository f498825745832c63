#!/usr/bin/env bash
# Ensures Debian's packages that the one-node test cluster (k8s/cluster) runs on this
# machine: containerd and runc (the container runtime), containernetworking-plugins (the
# bridge, host-local, loopback and portmap CNI plugins) and iptables with conntrack (for
# kube-proxy's iptables mode and the bridge plugin's masquerading).
#
# Installing the containerd package does not leave a containerd running where a
# /usr/sbin/policy-rc.d forbids starting services (as on this project's machines); where one
# was started by this install, it is stopped: the test runs its own containerd with its own
# state and socket, and never uses the system's.
#
#   scripts/node-packages.sh     installs what is missing (as root)
set -euo pipefail

need=()
for pair in containerd:/usr/bin/containerd runc:/usr/bin/runc \
  containernetworking-plugins:/usr/lib/cni/bridge iptables:/usr/sbin/iptables conntrack:/usr/sbin/conntrack; do
  [[ -x "${pair#*:}" ]] || need+=("${pair%%:*}")
done
if [[ ${#need[@]} -eq 0 ]]; then
  exit 0
fi
if [[ "$(id -u)" != 0 ]]; then
  echo "node-packages: missing ${need[*]} (apt-get install them as root)" >&2
  exit 1
fi
echo "node-packages: installing Debian's ${need[*]}" >&2
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2; }
if ! install; then
  apt-get update >&2
  install
fi
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet containerd 2>/dev/null; then
  echo "node-packages: stopping and disabling the packaged containerd service" >&2
  systemctl stop containerd >&2 || true
  systemctl disable containerd >&2 2>&1 || true
fi
