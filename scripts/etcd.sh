#!/usr/bin/env bash
# Ensures Debian's etcd (the etcd-server package, 3.4) and prints the path of its binary:
# the store of the real kube-apiserver that the Kubernetes manifest test (k8s/apiserver)
# applies the kustomize base and overlays to (see scripts/kube-apiserver.sh).
#
# The test starts its own etcd on free 127.0.0.1 ports with a data directory of its own and
# stops it afterwards; it never uses a system etcd. Installing the package may start the
# packaged etcd service on 127.0.0.1:2379 (where the machine lets packages start services;
# a Docker-style /usr/sbin/policy-rc.d prevents it): when it was this script that installed
# the package, that service is stopped and disabled again so that nothing keeps running.
#
#   scripts/etcd.sh          prints the path of etcd (installing the package if needed)
#
# Environment:
#   CURFEW_ETCD   use this etcd and do nothing else
#
# Progress goes to stderr; the only thing on stdout is the path.
set -euo pipefail

if [[ -n "${CURFEW_ETCD:-}" ]]; then
  echo "$CURFEW_ETCD"
  exit 0
fi
bin=/usr/bin/etcd
if [[ -x "$bin" ]]; then
  echo "$bin"
  exit 0
fi

if [[ "$(id -u)" != 0 ]]; then
  echo "etcd: $bin is missing (apt-get install etcd-server as root, or set CURFEW_ETCD)" >&2
  exit 1
fi
echo "etcd: installing Debian's etcd-server" >&2
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends etcd-server >&2; }
if ! install; then
  # The package lists may be missing on a fresh machine.
  apt-get update >&2
  install
fi

# The packaged service is not ours: stop it if the install started it.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
  echo "etcd: stopping and disabling the packaged etcd service" >&2
  systemctl stop etcd >&2 || true
  systemctl disable etcd >&2 2>&1 || true
elif [[ -x /etc/init.d/etcd ]] && /etc/init.d/etcd status >/dev/null 2>&1; then
  echo "etcd: stopping the packaged etcd service" >&2
  /etc/init.d/etcd stop >&2 || true
fi

if ! "$bin" --version >&2; then
  echo "etcd: $bin does not run" >&2
  exit 1
fi
echo "$bin"
