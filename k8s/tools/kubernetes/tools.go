//go:build tools

// Package tools pins k8s.io/kubernetes/cmd/kube-apiserver for scripts/kube-apiserver.sh.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
)
