package proc

import "syscall"

// sysProcAttr makes the kernel kill a child when the process that started it dies without
// calling Stop (a test binary killed at its -timeout, say), so that no server outlives its
// test.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
