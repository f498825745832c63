//go:build !linux

package proc

import "syscall"

// sysProcAttr has nothing to add where there is no parent-death signal: Stop ends the
// processes.
func sysProcAttr() *syscall.SysProcAttr {
	return nil
}
