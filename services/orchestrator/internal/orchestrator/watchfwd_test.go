package orchestrator

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// relayPlan streams text in each model step and sleeps between them: about a second.
const relayPlan = `{"tokens_per_second":50,"steps":[
  {"think_tokens":5,"tools":[{"name":"sleep","args":{"ms":300}}]},
  {"think_tokens":5,"tools":[{"name":"sleep","args":{"ms":300}}]},
  {"answer_tokens":5}]}`

// newRelayPair starts two orchestrators on one store, each naming an address in its
// leases that the other's Peers reaches it at.
func newRelayPair(t *testing.T, st store.Store) (a, b *env) {
	t.Helper()
	var mu sync.Mutex
	peers := map[string]orchestratorv1.OrchestratorServiceClient{}
	peer := func(addr string) (orchestratorv1.OrchestratorServiceClient, error) {
		mu.Lock()
		defer mu.Unlock()
		if c := peers[addr]; c != nil {
			return c, nil
		}
		return nil, status.Errorf(codes.Unavailable, "no orchestrator at %s", addr)
	}
	add := func(name string) *env {
		addr := name + ":7700"
		e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) {
			c.Store, c.Owner, c.LeaseTTL, c.DeadLetters, c.Peers = st, OwnerName(name, addr), time.Second, deadLetters{st}, peer
		})
		mu.Lock()
		peers[addr] = e.orch
		mu.Unlock()
		return e
	}
	return add("orch-a"), add("orch-b")
}

// watchLog checks a WatchRun's events as a client reads them: one started event first,
// one summary last, every text delta of a node where the node's text so far ends, and
// node events only between the summary's start and end. It returns the summary and the
// count of node updates and node events before it.
func watchLog(t *testing.T, evs []*orchestratorv1.WatchRunResponse) (fin *orchestratorv1.Run, nodes, events int) {
	t.Helper()
	if len(evs) < 2 || evs[0].GetStarted() == nil || evs[len(evs)-1].GetFinished() == nil {
		t.Fatalf("events %v: want started first and the summary last", evs)
	}
	text := map[string]string{}
	for i, ev := range evs {
		switch e := ev.GetEvent().(type) {
		case *orchestratorv1.WatchRunResponse_Started:
			if i != 0 {
				t.Errorf("event %d is a second started event", i)
			}
		case *orchestratorv1.WatchRunResponse_Finished:
			if i != len(evs)-1 {
				t.Errorf("event %d is a summary before the last event", i)
			}
		case *orchestratorv1.WatchRunResponse_Node:
			nodes++
		case *orchestratorv1.WatchRunResponse_NodeEvent:
			events++
			if d := e.NodeEvent.GetText(); d != nil {
				id := e.NodeEvent.GetNodeId()
				if d.GetOffset() != int64(len(text[id])) && len(text[id]) > 0 {
					t.Errorf("text of %s at offset %d after %d bytes: a repeat or a gap", id, d.GetOffset(), len(text[id]))
				}
				text[id] += d.GetText()
			}
		}
	}
	return evs[len(evs)-1].GetFinished(), nodes, events
}

// A WatchRun on a replica that does not own the run is relayed from its owner: the
// client sees the run's node updates and text as it runs, and its summary is GetRun's.
func TestWatchRunIsRelayedFromTheOwner(t *testing.T) {
	a, b := newRelayPair(t, openStore(t))
	acme := metadata.AppendToOutgoingContext(context.Background(), md.Tenant, "acme")
	resp, err := a.orch.StartRun(acme, &orchestratorv1.StartRunRequest{Task: relayPlan, Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetRun().GetRunId()
	w, err := b.orch.WatchRun(acme, &orchestratorv1.WatchRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	evs, err := meshtest.Drain(w)
	if err != nil {
		t.Fatalf("WatchRun via orch-b: %v", err)
	}
	fin, nodes, events := watchLog(t, evs)
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run ended %v: %s", fin.GetStatus(), fin.GetErrorMessage())
	}
	// The store alone has no node events: these came from the owner.
	if nodes < 3 || events < 3 {
		t.Errorf("%d node updates and %d node events before the summary, want the run's live (≥ 3 of each)", nodes, events)
	}
	got, err := b.orch.GetRun(acme, &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(got.GetRun(), fin) {
		t.Errorf("summary of the watch:\n%v\nGetRun:\n%v", fin, got.GetRun())
	}
	if n := len(b.decoders()); n != 0 {
		t.Errorf("orch-b ran %d decoders of a run orch-a owns", n)
	}
}

// Forwarding keeps tenants apart: another tenant's watch of the run is NOT_FOUND on a
// replica that does not own it (the store is read under the caller's tenant) and on its
// owner; and a forwarded watch of a run the receiver does not hold is not forwarded again.
func TestWatchRunForwardingKeepsTenantsAndDoesNotLoop(t *testing.T) {
	a, b := newRelayPair(t, openStore(t))
	acme := metadata.AppendToOutgoingContext(context.Background(), md.Tenant, "acme")
	resp, err := a.orch.StartRun(acme, &orchestratorv1.StartRunRequest{Task: sleepPlan(3000), Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetRun().GetRunId()
	a.waitDecoder(t)
	other := metadata.AppendToOutgoingContext(context.Background(), md.Tenant, "other")
	for name, e := range map[string]*env{"orch-a (owner)": a, "orch-b": b} {
		w, err := e.orch.WatchRun(other, &orchestratorv1.WatchRunRequest{RunId: id})
		if err == nil {
			_, err = meshtest.Drain(w)
		}
		if status.Code(err) != codes.NotFound {
			t.Errorf("another tenant's WatchRun via %s: %v, want NOT_FOUND", name, err)
		}
	}
	fwd := metadata.AppendToOutgoingContext(acme, md.CancelForwarded, "1")
	begin := time.Now()
	w, err := b.orch.WatchRun(fwd, &orchestratorv1.WatchRunRequest{RunId: id})
	if err == nil {
		_, err = meshtest.Drain(w)
	}
	meshtest.WantCode(t, err, codes.Unavailable, "not held by this orchestrator")
	if d := time.Since(begin); d > time.Second {
		t.Errorf("a forwarded watch of a run held elsewhere took %v to be refused", d)
	}
	if _, err := a.orch.CancelRun(acme, &orchestratorv1.CancelRunRequest{RunId: id}); err != nil {
		t.Fatal(err)
	}
}

// A relayed watch follows its run across a handover: the owner drains, the other
// replica takes the run over, and the watch on it goes on, here, to the run's summary.
func TestWatchRunFollowsTheRunAcrossAHandover(t *testing.T) {
	st := openStore(t)
	a, b := newRelayPair(t, st)
	ctx := context.Background()
	// 300 ms of text, then a sleep: the handover comes in one or the other, and a model
	// step cut off streams its text again on orch-b (the client gets only what it lacks).
	plan := `{"tokens_per_second":100,"steps":[
	  {"think_tokens":30,"tools":[{"name":"sleep","args":{"ms":2000}}]},
	  {"answer_tokens":2}]}`
	resp, err := a.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: plan, Timeout: durationpb.New(30 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetRun().GetRunId()
	a.waitDecoder(t)
	w, err := b.orch.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	var evs []*orchestratorv1.WatchRunResponse
	for { // live from the owner: up to its first node event
		ev, err := w.Recv()
		if err != nil {
			t.Fatalf("WatchRun via orch-b before the handover: %v", err)
		}
		evs = append(evs, ev)
		if ev.GetFinished() != nil {
			t.Fatal("the run ended before any node event reached orch-b's watch")
		}
		if ev.GetNodeEvent() != nil {
			break
		}
	}
	a.srv.Drain(time.Now().Add(500 * time.Millisecond))
	rest, err := meshtest.Drain(w)
	if err != nil {
		t.Fatalf("WatchRun via orch-b across the handover: %v", err)
	}
	fin, _, _ := watchLog(t, append(evs, rest...))
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetEpoch() != 2 {
		t.Fatalf("run ended %v at epoch %d (%s), want SUCCEEDED, taken over at epoch 2", fin.GetStatus(), fin.GetEpoch(), fin.GetErrorMessage())
	}
	got, err := b.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(got.GetRun(), fin) {
		t.Errorf("summary of the watch:\n%v\nGetRun:\n%v", fin, got.GetRun())
	}
	var after int
	for _, ev := range rest {
		if ev.GetNode() != nil {
			after++
		}
	}
	if after == 0 {
		t.Error("no node update after the handover: the watch did not follow the run on orch-b")
	}
}

// sentStream is a WatchRun server stream that records what is sent.
type sentStream struct {
	grpc.ServerStream
	sent []*orchestratorv1.WatchRunResponse
}

func (s *sentStream) Send(r *orchestratorv1.WatchRunResponse) error {
	s.sent = append(s.sent, r)
	return nil
}

func (s *sentStream) log() []string {
	var out []string
	for _, r := range s.sent {
		switch e := r.GetEvent().(type) {
		case *orchestratorv1.WatchRunResponse_Started:
			out = append(out, "started")
		case *orchestratorv1.WatchRunResponse_Node:
			out = append(out, "node "+e.Node.GetId()+" "+strings.TrimPrefix(e.Node.GetStatus().String(), "NODE_STATUS_"))
		case *orchestratorv1.WatchRunResponse_NodeEvent:
			if d := e.NodeEvent.GetText(); d != nil {
				out = append(out, fmt.Sprintf("text %s %d %s", e.NodeEvent.GetNodeId(), d.GetOffset(), d.GetText()))
				continue
			}
			out = append(out, fmt.Sprintf("event %s %g", e.NodeEvent.GetNodeId(), e.NodeEvent.GetProgress().GetProgress()))
		case *orchestratorv1.WatchRunResponse_Finished:
			out = append(out, "finished")
		}
	}
	return out
}

// What a new source replays that the client already has is not sent again: one
// started event, a progress equal to the last one sent, the text already sent.
func TestWatcherDropsWhatANewSourceReplays(t *testing.T) {
	st := &sentStream{}
	w := newWatcher(st, detailAll)
	r := &orchestratorv1.Run{RunId: "r", Deadline: timestamppb.Now()}
	at := timestamppb.Now()
	p1 := prog("root/s0.t0", 1)
	p1.At = at
	steps := []func() error{
		func() error { return w.sendStarted(r) },
		func() error { return w.sendNode(runningNode("root/s0.t0")) },
		func() error { return w.sendEvent(p1) },
		func() error { return w.sendEvent(textEv("root/m0", 0, "ab")) },
		func() error { return w.sendEvent(textEv("root/m0", 2, "cd")) },
		// A new source: its started event and its replay.
		func() error { return w.sendStartedEvent(&orchestratorv1.RunStarted{RunId: "r"}) },
		func() error { return w.sendEvent(proto.Clone(p1).(*meshv1.NodeEvent)) },
		func() error { return w.sendEvent(textEv("root/m0", 0, "abcde")) },
		func() error { return w.sendEvent(textEv("root/m0", 5, "f")) },
		func() error { return w.sendEvent(textEv("root/m0", 2, "cd")) },
		func() error { return w.sendEvent(prog("root/s0.t0", 2)) },
		// A node's end forgets it: a repeat of the node starts afresh.
		func() error { return w.sendNode(endedNode("root/s0.t0")) },
		func() error { return w.sendEvent(proto.Clone(p1).(*meshv1.NodeEvent)) },
		func() error { return w.finish(r) },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	want := []string{
		"started", "node root/s0.t0 RUNNING", "event root/s0.t0 1", "text root/m0 0 ab", "text root/m0 2 cd",
		"text root/m0 4 e", "text root/m0 5 f", "event root/s0.t0 2",
		"node root/s0.t0 SUCCEEDED", "event root/s0.t0 1", "finished",
	}
	if got := st.log(); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("sent:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
