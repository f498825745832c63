package bench

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// echoEnv makes the test binary an echo server (see TestMain).
const echoEnv = "CURFEW_BENCH_ECHO"

// echoServer accepts one loopback TCP connection, echoes it until it closes, and returns
// the exit code. It prints its address on stdout first.
func echoServer() int {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(lis.Addr().String())
	c, err := lis.Accept()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	_, _ = io.Copy(c, c)
	return 0
}

// rttGap is the pause before each ping: long enough for both processes to go idle, as the
// services do between a decoder's tokens, so each ping pays the wake-up of an idle process.
const rttGap = 2 * time.Millisecond

// BenchmarkLoopbackRTT is the machine's floor for one cross-process hop: the round trip of
// one byte between this process and a child process (the test binary as an echo server)
// over loopback TCP, each ping after a pause of rttGap. The cancel benchmark's hops cost
// at least half of this each, and its tail inherits this tail. Run with
// -benchtime=<pings>x.
func BenchmarkLoopbackRTT(b *testing.B) {
	cmd := exec.Command(os.Args[0], "-test.run", "^$")
	cmd.Env = append(os.Environ(), echoEnv+"=1")
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = cmd.Wait() }()
	addr, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		_ = cmd.Process.Kill()
		b.Fatal(err)
	}
	c, err := net.Dial("tcp", strings.TrimSpace(addr))
	if err != nil {
		_ = cmd.Process.Kill()
		b.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	buf := []byte{1}
	var d Dist
	for b.Loop() {
		time.Sleep(rttGap)
		t0 := time.Now()
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			b.Fatal(err)
		}
		d = append(d, time.Since(t0))
	}
	b.ReportMetric(float64(d.Quantile(.5))/1e3, "p50-µs")
	b.ReportMetric(float64(d.Quantile(.9))/1e3, "p90-µs")
	b.ReportMetric(float64(d.Quantile(.99))/1e3, "p99-µs")
	b.ReportMetric(float64(d.Max())/1e3, "max-µs")
	addReport(fmt.Sprintf("\nloopback TCP round trip to an idle child process, %d pings %v apart (µs)\n| p50 | p90 | p99 | p99.9 | max |\n|---:|---:|---:|---:|---:|\n| %s | %s | %s | %s | %s |\n",
		len(d), rttGap, us(d.Quantile(.5)), us(d.Quantile(.9)), us(d.Quantile(.99)), us(d.Quantile(.999)), us(d.Max())))
}
