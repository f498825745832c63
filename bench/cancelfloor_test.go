package bench

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// BenchmarkCancelFloor measures BenchmarkCancelPropagation's 64-leaf trees beside their
// floor, alternating iteration by iteration in one run: curfew (the real mesh under
// `curfew up`, mTLS, as BenchmarkCancelPropagation runs it) and the bare tree
// (startBareTree: the same four processes, the same plan and hops — orchestrator →
// toolrunner → subagent per level, the leaves' Generate streams in the model process —
// on bare grpc-go, plaintext, where the only stop signal is grpc-go's own context
// cancellation hop by hop). Both time the client's cancel of its Run call to the last
// of the 64 leaf decoders seeing it, on the model process's clock. The floor is
// plaintext, so it is if anything a little low, which makes "≤ 2× the floor" stricter.
//
// Goal (issue 26): curfew's p99 ≤ 5 ms, or ≤ 2× the floor's p99 measured in the same
// run. Run it with -benchtime=<iterations>x (per side).
func BenchmarkCancelFloor(b *testing.B) {
	orch, mp, ps := startCancelMesh(b)
	bare := startBareTree(b, leafTPS, true)
	var rows []string
	for _, s := range Shapes {
		if s.Leaves != 64 {
			continue
		}
		b.Run(s.Name(), func(b *testing.B) {
			task := TreePlan(s, leafTokens, leafTPS)
			ctx := context.Background()
			curfewOnce := func() (time.Duration, error) {
				smp, err := cancelOnce(ctx, orch, mp, ps, s, task)
				return smp.clientToLast, err
			}
			bareOnce := func() (time.Duration, error) { return bareCancelOnce(ctx, bare, s, task) }
			for _, f := range []func() (time.Duration, error){curfewOnce, bareOnce} { // warm-up
				if _, err := f(); err != nil {
					b.Fatal(err)
				}
			}
			var dists [2]Dist // curfew, bare
			i := 0
			for b.Loop() {
				order := []int{0, 1}
				if i%2 == 1 {
					order = []int{1, 0}
				}
				for _, side := range order {
					f := curfewOnce
					if side == 1 {
						f = bareOnce
					}
					d, err := f()
					if err != nil {
						b.Fatal(err)
					}
					dists[side] = append(dists[side], d)
				}
				i++
			}
			c, f := dists[0], dists[1]
			b.ReportMetric(msf(c.Quantile(.5)), "p50-curfew-ms")
			b.ReportMetric(msf(c.Quantile(.99)), "p99-curfew-ms")
			b.ReportMetric(msf(f.Quantile(.5)), "p50-floor-ms")
			b.ReportMetric(msf(f.Quantile(.99)), "p99-floor-ms")
			b.ReportMetric(float64(c.Quantile(.99))/float64(f.Quantile(.99)), "p99-curfew/floor-x")
			rows = append(rows, fmt.Sprintf("| %d | %d | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %.2f | %s |",
				s.Leaves, s.Depth, s.Desc(), len(c),
				ms(c.Quantile(.5)), ms(c.Quantile(.9)), ms(c.Quantile(.99)), ms(c.Max()),
				ms(f.Quantile(.5)), ms(f.Quantile(.9)), ms(f.Quantile(.99)), ms(f.Max()),
				float64(c.Quantile(.99))/float64(f.Quantile(.99)), loadAvg()))
		})
	}
	addReport("\ncancel at 64 leaves beside bare grpc-go's own cancel (the floor), alternating: client cancel → last leaf decoder stopped (ms)\n" +
		"| leaves | depth | tree | n | curfew p50 | p90 | p99 | max | floor p50 | p90 | p99 | max | p99 curfew/floor | load at end |\n" +
		"|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n" + strings.Join(rows, "\n") + "\n")
}

// bareCancelOnce is one iteration of cancelOnce on the bare tree: a Run of task, every
// leaf decoding, steadyPause, the client's cancel, quietPause; it returns the time from
// the cancel to the last leaf's end, as the model process reported it.
func bareCancelOnce(ctx context.Context, t *bareTree, s Shape, task string) (time.Duration, error) {
	for len(t.events) > 0 { // nothing of an earlier iteration may count
		<-t.events
	}
	rctx, cancel := context.WithTimeout(ctx, runDeadline)
	defer cancel()
	st, err := t.orch.Run(rctx, &orchestratorv1.RunRequest{Task: task})
	if err != nil {
		return 0, err
	}
	if _, err := st.Recv(); err != nil {
		return 0, fmt.Errorf("bare run: first event: %w", err)
	}
	timeout := time.After(30 * time.Second)
	for n := 0; n < s.Leaves; {
		select {
		case ev := <-t.events:
			if ev == bareDecoding {
				n++
			}
		case <-timeout:
			return 0, fmt.Errorf("bare run: %d of %d leaves decoding after 30 s", n, s.Leaves)
		}
	}
	drained := make(chan struct{})
	go func() { defer close(drained); _ = drain(st.Recv) }()
	time.Sleep(steadyPause)
	t0 := time.Now()
	cancel()
	<-drained
	time.Sleep(quietPause)
	var last int64
	timeout = time.After(10 * time.Second)
	for n := 0; n < s.Leaves; {
		select {
		case ev := <-t.events:
			at, ok := strings.CutPrefix(ev, bareEnded+" ")
			if !ok {
				continue
			}
			ns, err := strconv.ParseInt(at, 10, 64)
			if err != nil {
				return 0, err
			}
			last = max(last, ns)
			n++
		case <-timeout:
			return 0, fmt.Errorf("bare run: %d of %d leaves ended 10 s after the cancel", n, s.Leaves)
		}
	}
	return time.Duration(last - t0.UnixNano()), nil
}
