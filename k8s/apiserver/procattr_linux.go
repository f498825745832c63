package apiserver

import "syscall"

// sysProcAttr makes the kernel kill etcd and kube-apiserver when the process that started
// them dies without calling Stop (a test binary killed at its -timeout, say), so that no
// server outlives its test.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
