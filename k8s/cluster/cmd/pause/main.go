// Command pause is the sandbox container of the test cluster's pods, the counterpart of
// registry.k8s.io/pause (kubernetes/build/pause/linux/pause.c): it holds the pod's namespaces
// by doing nothing until SIGINT or SIGTERM, then exits 0. In a pod that shares its process
// namespace (shareProcessNamespace) it is PID 1, which the processes orphaned in the pod are
// given to, so it reaps every child that exits (on SIGCHLD), lest they stay zombies.
//
// It is static (CGO_ENABLED=0) and runs alone in its image; -v prints its version.
package main

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		fmt.Println("pause (curfew k8s/cluster)")
		return
	}
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "Warning: pause should be the first process")
	}
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			fmt.Fprintf(os.Stderr, "Shutting down, got signal: %v\n", s)
			os.Exit(0)
		}
		reap()
	}
}

// reap waits for every child that has exited, without blocking: signals coalesce, so one
// SIGCHLD may stand for several children.
func reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
	}
}
