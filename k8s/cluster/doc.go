// Package cluster runs a one-node Kubernetes cluster on this machine for the test that
// applies the manifests as real pods: etcd and kube-apiserver (package apiserver),
// containerd and runc from Debian with the CNI bridge, host-local, loopback and portmap
// plugins, kube-controller-manager, kube-scheduler, the kubelet and kube-proxy (iptables
// mode) built from k8s.io/kubernetes, and CoreDNS for the headless Services' names. The
// control plane, kube-proxy and CoreDNS run as processes on the node, as static pods would;
// everything the manifests describe runs as pods.
//
// It also builds the images those pods run without a registry (ServiceImage, PauseImage,
// PostgresImage, NATSImage) and imports them into containerd.
//
// It needs root, and tears down everything it made (processes, mounts, network namespaces,
// the bridge, iptables rules, sysctls, state directories) in Stop, also after a failure.
package cluster
