package launch

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// childEnv makes the test binary a fake service: "serve" serves gRPC health on --addr
// (SERVING) and prints its arguments, then "stopped" on SIGTERM; "exit" exits with
// status 3; "hang" never serves.
const childEnv = "LAUNCH_TEST_CHILD"

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(child(mode, os.Args[1:]))
	}
	os.Exit(m.Run())
}

func child(mode string, args []string) int {
	switch mode {
	case "exit":
		return 3
	case "hang":
		time.Sleep(time.Minute)
		return 0
	}
	var addr string
	for i, a := range args {
		if a == "--addr" && i+1 < len(args) {
			addr = args[i+1]
		}
	}
	l, err := net.Listen("tcp", addr) //nolint:noctx // a test's fake service
	if err != nil {
		fmt.Println(err)
		return 1
	}
	s := grpc.NewServer()
	healthpb.RegisterHealthServer(s, health.NewServer())
	go func() { _ = s.Serve(l) }()
	fmt.Println("args", strings.Join(args, " "))
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM)
	<-sig
	s.Stop()
	fmt.Println("stopped", time.Now().UnixNano())
	return 0
}

func fake(t *testing.T, mode, name string) *Process {
	t.Helper()
	t.Setenv(childEnv, mode)
	eps, err := Allocate(0)
	if err != nil {
		t.Fatal(err)
	}
	addr := eps["orchestrator"].Addr
	return &Process{Name: name, Bin: os.Args[0], Args: []string{"--addr", addr}, Addr: addr, Log: filepath.Join(t.TempDir(), name+".log")}
}

// A process starts, serves, stops on SIGTERM, and starts again on the same address.
func TestProcessStartStopRestart(t *testing.T) {
	p := fake(t, "serve", "svc")
	ctx := context.Background()
	for round := range 2 {
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
		if err := WaitServing(ctx, 10*time.Second, p); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if !p.Running() || p.PID() == 0 {
			t.Fatalf("round %d: running %v, pid %d", round, p.Running(), p.PID())
		}
		if err := p.Start(); err == nil {
			t.Errorf("round %d: a second Start of a running process", round)
		}
		if err := p.Stop(5 * time.Second); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if p.Running() {
			t.Errorf("round %d: running after Stop", round)
		}
		select {
		case <-p.Done():
		default:
			t.Errorf("round %d: Done not closed after Stop", round)
		}
	}
	b, _ := os.ReadFile(p.Log)
	if n := strings.Count(string(b), "stopped"); n != 2 {
		t.Errorf("log shows %d graceful stops, want 2 (the log is appended to):\n%s", n, b)
	}
}

// WaitServing fails early, naming the process, when it exits during start-up, and after
// the timeout when it never serves; Kill ends a process at once.
func TestWaitServingFailures(t *testing.T) {
	ctx := context.Background()
	p := fake(t, "exit", "quitter")
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err := WaitServing(ctx, 20*time.Second, p)
	if err == nil || !strings.Contains(err.Error(), "quitter exited during start-up: exit status 3") || time.Since(start) > 10*time.Second {
		t.Errorf("exit during start-up: %v after %v", err, time.Since(start))
	}

	p = fake(t, "hang", "sleeper")
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	err = WaitServing(ctx, 300*time.Millisecond, p)
	if err == nil || !strings.Contains(err.Error(), "sleeper did not report SERVING within 300ms") {
		t.Errorf("never serving: %v", err)
	}
	if err := p.Kill(); err != nil || p.Running() {
		t.Errorf("kill: %v, running %v", err, p.Running())
	}
}
