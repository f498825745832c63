package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
)

// Settings of the front-door disconnect benchmark.
const (
	// disconnectStreams is how many streams a round opens at once, unless
	// CURFEW_BENCH_DISCONNECT_STREAMS says otherwise.
	disconnectStreams = 64
	// slowTokens at slowInterval keep every stream decoding for 8 s, far longer than a
	// round; the reply then hangs (writes nothing) until its client goes, so that no
	// stream ends on its own.
	slowTokens   = 400
	slowInterval = "20ms"
)

// stopRound is one round's figures, per stream.
type stopRound struct {
	door bool
	// upstream: the client's disconnect → the model server saw its request's context
	// end (openaitest's GoneAt: the upstream HTTP stream closed).
	upstream Dist
	// decoder (door only): the client's disconnect → modelproxy's ended_at of the run's
	// model node, written when the decoder's loop returned.
	decoder Dist
	// cpu is the CPU time each service used from the disconnect to quietPause after it
	// (index as serviceNames): the teardown of n streams.
	cpu [4]time.Duration
	// steady is the CPU time the four services used together during steadyPause, with
	// every stream decoding: the load the teardown lands on.
	steady time.Duration
	load   string
}

func streamsOf() (int, error) {
	v := os.Getenv("CURFEW_BENCH_DISCONNECT_STREAMS")
	if v == "" {
		return disconnectStreams, nil
	}
	return strconv.Atoi(v)
}

// BenchmarkFrontDoorDisconnect measures, over the real processes, how long a client's
// disconnect at the front door takes to stop the model server's streams: n concurrent
// streamed completions (64 by default) each decoding slowly (a token every 20 ms), all
// disconnected at once, timed per stream from the disconnect to the instant the model
// server saw that stream's request end (openaitest records GoneAt per call), and to
// modelproxy's own record of the decoder's end (ended_at of the run's model node).
//
// Each iteration is two rounds, in an order that alternates with the iteration:
//
//   - door: n POST /v1/chat/completions with "stream": true to the front door; each
//     client reads its stream as it comes;
//   - floor: the same n streams against the model server directly, with the body
//     modelproxy sends it.
//
// A round waits until every stream has delivered content (every decoder running), then
// steadyPause, notes t0 and cancels every request's context (the transport closes each
// connection), then quietPause before it reads the records: the model server's calls
// (every one must have ended with its client gone) and, for door, modelproxy's nodes of
// every run (ListNodes with a settle timeout; every model node must have been
// cancelled). Metrics: p50/p99/max over all streams of all rounds, per path, in ms
// (issue 21's target: p99 ≤ 10 ms).
func BenchmarkFrontDoorDisconnect(b *testing.B) {
	n, err := streamsOf()
	if err != nil || n < 1 {
		b.Fatalf("CURFEW_BENCH_DISCONNECT_STREAMS: %v", err)
	}
	mm := startModelMesh(b)
	ctx := context.Background()
	body := mm.upstreamBody(b)
	load0 := loadAvg()
	for _, door := range []bool{true, false} { // warm-up, not recorded
		if _, err := mm.disconnectRound(ctx, door, n, body); err != nil {
			b.Fatal(err)
		}
	}
	var rounds []stopRound
	i := 0
	for b.Loop() {
		for k := range 2 {
			door := (i+k)%2 == 0
			r, err := mm.disconnectRound(ctx, door, n, body)
			if err != nil {
				b.Fatal(err)
			}
			rounds = append(rounds, r)
		}
		i++
	}
	var door, floor, dec Dist
	for _, r := range rounds {
		if r.door {
			door = append(door, r.upstream...)
			dec = append(dec, r.decoder...)
		} else {
			floor = append(floor, r.upstream...)
		}
	}
	for _, x := range []struct {
		name string
		d    Dist
	}{{"door", door}, {"decoder", dec}, {"floor", floor}} {
		b.ReportMetric(msf(x.d.Quantile(.5)), x.name+"-p50-ms")
		b.ReportMetric(msf(x.d.Quantile(.99)), x.name+"-p99-ms")
		b.ReportMetric(msf(x.d.Max()), x.name+"-max-ms")
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nfront-door disconnect → upstream stream closed at the model server (ms), %d streams per round, load %s at start, %s at end\n", n, load0, loadAvg())
	fmt.Fprintf(&sb, "| round | path | p50 | p90 | p99 | max | min | modelproxy ended_at p50 / p99 / max | teardown CPU ms: orch / tool / sub / model | steady CPU ms per 100 ms | load (1 min) |\n|---:|---|---:|---:|---:|---:|---:|---|---|---:|---:|\n")
	for j, r := range rounds {
		path, dcol := "floor", "–"
		if r.door {
			path = "door"
			dcol = ms(r.decoder.Quantile(.5)) + " / " + ms(r.decoder.Quantile(.99)) + " / " + ms(r.decoder.Max())
		}
		u := r.upstream
		fmt.Fprintf(&sb, "| %d | %s | %s | %s | %s | %s | %s | %s | %s / %s / %s / %s | %s | %s |\n", j+1, path,
			ms(u.Quantile(.5)), ms(u.Quantile(.9)), ms(u.Quantile(.99)), ms(u.Max()), ms(u.Min()), dcol,
			ms1(r.cpu[0]), ms1(r.cpu[1]), ms1(r.cpu[2]), ms1(r.cpu[3]), ms1(r.steady*(100*time.Millisecond)/steadyPause), r.load)
	}
	addReport(sb.String())
}

// disconnectRound runs one round of BenchmarkFrontDoorDisconnect.
func (mm *modelMesh) disconnectRound(ctx context.Context, door bool, n int, body []byte) (stopRound, error) {
	r := stopRound{door: door}
	before, err := mm.model.calls()
	if err != nil {
		return r, err
	}
	slow := map[string]any{"content": tokens(slowTokens), "interval": slowInterval, "hang": true}
	replies := make([]map[string]any, n)
	for i := range replies {
		replies[i] = slow
	}
	if err := mm.model.enqueue(replies); err != nil {
		return r, err
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type first struct {
		id  string
		err error
	}
	ready := make(chan first, n)
	var wg sync.WaitGroup
	for range n {
		reqBody := body
		if door {
			reqBody = doorBody()
		}
		req, hc := mm.streamRequest(rctx, door, reqBody)
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := hc.Do(req)
			if err != nil {
				ready <- first{err: err}
				return
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b, _ := io.ReadAll(resp.Body)
				ready <- first{err: fmt.Errorf("%s: %s", resp.Status, b)}
				return
			}
			br := bufio.NewReader(resp.Body)
			c, err := firstContent(br)
			ready <- first{id: c.ID, err: err}
			_, _ = io.Copy(io.Discard, br) // read on, as the tokens come, until the disconnect
		}()
	}
	var runs []string
	timeout := time.After(time.Minute)
	for range n {
		select {
		case f := <-ready:
			if f.err != nil {
				cancel()
				wg.Wait()
				return r, fmt.Errorf("a stream before the disconnect: %w", f.err)
			}
			runs = append(runs, f.id)
		case <-timeout:
			cancel()
			wg.Wait()
			return r, fmt.Errorf("%d streams: not all delivered content within a minute", n)
		}
	}
	cpuS, err := cpuTimes(mm.procsOf.pids)
	if err != nil {
		cancel()
		wg.Wait()
		return r, err
	}
	time.Sleep(steadyPause)
	cpu0, err := cpuTimes(mm.procsOf.pids)
	if err != nil {
		cancel()
		wg.Wait()
		return r, err
	}
	for i := range cpu0 {
		r.steady += cpu0[i] - cpuS[i]
	}
	t0 := time.Now()
	cancel() // the client disconnects every stream
	wg.Wait()
	time.Sleep(quietPause)
	cpu1, err := cpuTimes(mm.procsOf.pids)
	if err != nil {
		return r, err
	}
	for i := range cpu1 {
		r.cpu[i] = cpu1[i] - cpu0[i]
	}
	r.load = strings.Fields(loadAvg())[0]

	if door {
		for _, run := range runs {
			lctx, lcancel := context.WithTimeout(ctx, 15*time.Second)
			resp, err := mm.mp.ListNodes(lctx, &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(10 * time.Second)})
			lcancel()
			if err != nil {
				return r, fmt.Errorf("modelproxy ListNodes %s: %w", run, err)
			}
			if !resp.GetSettled() {
				return r, fmt.Errorf("run %s: modelproxy's decoder had not stopped 10 s after the disconnect", run)
			}
			var found bool
			for _, nd := range resp.GetNodes() {
				if nd.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL {
					continue
				}
				if nd.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || nd.GetEndedAt() == nil {
					return r, fmt.Errorf("run %s: model node %s ended %v, want cancelled", run, nd.GetId(), nd.GetStatus())
				}
				r.decoder = append(r.decoder, nd.GetEndedAt().AsTime().Sub(t0))
				found = true
			}
			if !found {
				return r, fmt.Errorf("run %s: modelproxy has no model node", run)
			}
		}
	}

	// The model server's calls of this round, once every one has ended.
	end := time.Now().Add(10 * time.Second)
	for {
		calls, err := mm.model.calls()
		if err != nil {
			return r, err
		}
		mine := calls[len(before):]
		ended := 0
		for _, c := range mine {
			if !c.End.IsZero() {
				ended++
			}
		}
		if len(mine) == n && ended == n {
			for _, c := range mine {
				if !c.ClientGone {
					return r, fmt.Errorf("model server call %d ended without its client gone (%d chunks)", c.N, c.Chunks)
				}
				r.upstream = append(r.upstream, c.GoneAt.Sub(t0))
			}
			return r, nil
		}
		if len(mine) > n {
			return r, fmt.Errorf("the model server saw %d requests in a round of %d streams", len(mine), n)
		}
		if time.Now().After(end) {
			return r, fmt.Errorf("%d of %d model server calls ended 10 s after the disconnect", ended, len(mine))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// tokens returns n content tokens "t1 ", "t2 ", … (as openaitest.Tokens).
func tokens(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = "t" + strconv.Itoa(i+1) + " "
	}
	return out
}
