//go:build tools

// Package tools pins the Kubernetes commands that the repository's scripts build from
// k8s.io/kubernetes: kube-apiserver for the manifests' server-side dry-run
// (scripts/kube-apiserver.sh), and the rest of a one-node cluster for the test that runs
// the manifests as real pods (scripts/kube-node.sh).
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
