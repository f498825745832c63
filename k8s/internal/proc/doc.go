// Package proc runs the child processes of the Kubernetes tests (etcd, kube-apiserver, and
// the one-node cluster's kubelet, containerd and the rest): each with its output in a log
// file, stopped with SIGTERM and then SIGKILL, killed by the kernel if the test binary dies
// first, and polled for readiness with the log quoted when it is not.
package proc
