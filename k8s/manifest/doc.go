// Package manifest builds curfew's Kubernetes manifests (k8s/base, k8s/overlays/*) with the
// kustomize API and decodes every object strictly into the Kubernetes Go types, so that
// the tests of this module check what a platform team would apply.
package manifest
