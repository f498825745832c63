// Package apiserver runs a real kube-apiserver over a real etcd on loopback for the tests
// of curfew's Kubernetes manifests: no scheduler, no kubelet, no pods, only the API server
// that admits, defaults and validates the objects as a cluster would.
//
// Start launches Debian's etcd (scripts/etcd.sh) with a temporary data directory and the
// kube-apiserver built from the pinned wrapper module k8s/tools/kubernetes
// (scripts/kube-apiserver.sh) on free 127.0.0.1 ports, with a generated service-account
// key and a token file whose one token belongs to system:masters, waits for /readyz and
// hands back a *rest.Config for that token. Stop ends both processes and removes every
// temporary file. The binaries come from Options, or else from CURFEW_KUBE_APISERVER and
// CURFEW_ETCD.
//
// The tests of this package render k8s/base and k8s/overlays/{dev,prod} with kustomize and
// apply every object with a server-side dry-run and strict field validation, so that an
// unknown or misplaced field, a wrong type or an invalid value fails the test with the
// API server's own message.
package apiserver
