package orchestrator

import (
	"context"
	"errors"
	"maps"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// eventBuffer is the per-subscriber buffer of progress events; a slow client loses
// progress events (never the summary) rather than slowing the run.
const eventBuffer = 256

// maxRunningNodes bounds the running nodes a run keeps track of for its node events
// (see run.running): a node started beyond it sends none. A plan's tool calls alone
// are at most plan.MaxToolCalls.
const maxRunningNodes = 4096

// maxStreamedNodes bounds the model nodes whose streamed tokens a run keeps (run.streamed).
const maxStreamedNodes = 4096

// maxNodeText and maxRunText bound the text of running model nodes a run keeps for late
// subscribers (see run.text): the latest maxNodeText bytes of each node, and
// maxRunText bytes in all. A node whose text would take the run past maxRunText is
// replayed without text until its next delta fits.
const (
	maxNodeText = 16 << 10
	maxRunText  = 256 << 10
)

// errLeaseLost stops a run this process no longer owns; errHandover one it gives up.
var (
	errLeaseLost = errors.New("another orchestrator claimed the run")
	errHandover  = errors.New("orchestrator shutting down: run handed over")
)

// run is a run this process advances (or advanced: ended runs stay until MaxRuns pushes
// them out, and out of a private store with them): its record, its cancel, its lease
// and its subscribers.
type run struct {
	id       string
	dl       time.Time
	cancel   context.CancelCauseFunc
	done     chan struct{}
	mu       sync.Mutex
	rec      *orchestratorv1.Run
	cancelAt time.Time // first explicit cancel instant
	// broadcast tells the executors to cancel the run's nodes (one hop), beside the
	// RST_STREAM that travels down the tree hop by hop: with decodersFirst, modelproxy
	// first, waiting for its answer up to decoderWait, and then the rest; otherwise all
	// at once. It returns when the rest may go on (the other executors are told in the
	// background).
	broadcast   func(cause error, decodersFirst bool)
	broadcasted bool
	subs        map[chan *orchestratorv1.RunResponse]detail // what each is sent; nil when there are none
	// running are the nodes published as started and not yet as ended (nor any node
	// above them), each with the latest event of every kind a late subscriber is replayed
	// (see replayed). A node event is published only for one of them: none before its
	// node's start, none after its end. At most maxRunningNodes; nil when there are none.
	running map[string][]*meshv1.NodeEvent
	// failedCalls are the tool nodes the loop published as failed, as the loop saw them:
	// the summary's record of a call its executor refused before recording it (arguments
	// that fail the tool's schema, an unknown tool), whose error went back to the model.
	// An executor's own record of a node comes first (collect).
	failedCalls []*meshv1.Node
	// reaches is which executors may hold nodes of the run: the node reports collect
	// asks (reportSet). Every one for a run this process did not start.
	reaches reportSet
	// streamed counts, per model node, the tokens the loops published for it over all
	// its attempts (collect): for a node that ran more than one attempt the summary takes
	// it where the executor's record has fewer, as when a modelproxy that died mid-stream
	// took its record of an attempt with it and its restart knows only the retry's. A
	// node of one attempt keeps its executor's figure, the ledger's truth (a drill's
	// cross-check of the ledger against the streamed tokens relies on it). At most
	// maxStreamedNodes.
	streamed map[string]*streamedTokens
	// text is the latest text of running model nodes (its TextDelta events), which a
	// late subscriber is sent as one delta per node; textBytes is its total length. Bounded
	// by maxNodeText and maxRunText; nil when there is none.
	text      map[string]*keptText
	textBytes int
	// span is the run's span (package tracing): every call the run makes is its child.
	span trace.Span

	// The run's lease (all guarded by mu), and why this process stopped advancing the
	// run without ending it.
	lease     store.Lease
	finishing bool // the result is being committed: heartbeats no longer matter
	// unstored: the run ended here but its result could not be stored (the store was
	// down). It stays in memory, and when the lease scan reclaims it (its lease lapsed
	// meanwhile), its result is stored then, not the run resumed: its client has seen
	// it end (resume).
	unstored bool
	lost     bool // another orchestrator claimed the run
	handover bool // shutting down: release the lease for another orchestrator

	// orphan is the chaos setting orphan (a drill's naive baseline): a client's
	// disconnect or an operator's cancel is recorded but not acted on.
	orphan bool

	// ticket is the run's admission, released when the run ends here (nil: not admitted
	// by this process, as a run taken over from a dead owner).
	ticket *admission.Ticket
}

// newRun returns a run as its store row r records it, not yet launched, under r's lease.
// Its nodes may be anywhere (reaches): a run this process starts says otherwise.
func newRun(r store.Run) *run {
	return &run{
		id: r.RunID, dl: r.Deadline, done: make(chan struct{}), lease: r.Lease(), reaches: allReports,
		rec: &orchestratorv1.Run{RunId: r.RunID, Tenant: r.Tenant, Status: orchestratorv1.RunStatus_RUN_STATUS_RUNNING,
			Deadline: timestamppb.New(r.Deadline), CreatedAt: timestamppb.New(r.CreatedAt), Model: r.Model, Task: string(r.Task),
			IdempotencyKey: r.IdempotencyKey, Input: decodeInput(r.Input), StartedBy: r.StartedBy},
	}
}

// streamedTokens are a model node's tokens as its loop published them. A node runs once
// per attempt of its step: a stream restarted under the same node goes on counting
// (mesh/agent), while a step redone after it failed (the run parked on an open breaker,
// say) starts a new node of the same id from 0. earlier sums the attempts that ended;
// current is the latest attempt's most.
type streamedTokens struct {
	earlier, current int64
	ended            bool // the latest attempt ended: a running node is a new one
	// retried: the node ran more than one attempt (a step redone, or a stream restarted:
	// the node's Attempt above 1). Only then may the executor's record lack one.
	retried bool
}

func (t *streamedTokens) total() int64 { return t.earlier + t.current }

// countStreamed counts model node n's tokens in rn.streamed; rn.mu is held.
func (rn *run) countStreamed(n *meshv1.Node) {
	t := rn.streamed[n.GetId()]
	if t == nil {
		if len(rn.streamed) >= maxStreamedNodes {
			return
		}
		if rn.streamed == nil {
			rn.streamed = map[string]*streamedTokens{}
		}
		t = &streamedTokens{}
		rn.streamed[n.GetId()] = t
	}
	running := n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING
	if running && t.ended { // a new attempt
		t.earlier, t.current, t.ended, t.retried = t.total(), 0, false, true
	}
	t.retried = t.retried || n.GetAttempt() > 1
	t.current = max(t.current, n.GetTokens())
	t.ended = !running
}

// publishNode publishes a node's start, update or end.
func (rn *run) publishNode(n *meshv1.Node) {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	id := n.GetId()
	if n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL {
		rn.countStreamed(n)
	}
	rn.reaches |= reachedBy(n)
	if n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
		if _, ok := rn.running[id]; !ok && len(rn.running) < maxRunningNodes {
			if rn.running == nil {
				rn.running = map[string][]*meshv1.NodeEvent{}
			}
			rn.running[id] = nil
		}
	} else {
		if n.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL && n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_FAILED &&
			len(rn.failedCalls) < maxRunningNodes {
			rn.failedCalls = append(rn.failedCalls, n)
		}
		// Ended, and with it whatever ran beneath it: a nested node whose own end was lost
		// with its caller's stream (a cancelled subagent's) ends here too.
		for k := range rn.running {
			if k == id || strings.HasPrefix(k, id+"/") {
				delete(rn.running, k)
				if kt := rn.text[k]; kt != nil {
					rn.textBytes -= len(kt.text)
					delete(rn.text, k)
				}
			}
		}
		if len(rn.text) == 0 {
			rn.text = nil
		}
		if len(rn.running) == 0 {
			rn.running = nil
		}
	}
	rn.publish(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Node{Node: n}})
}

// publishEvent publishes a node event, if its node is running; it drops it otherwise.
func (rn *run) publishEvent(ev *meshv1.NodeEvent) {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	kept, ok := rn.running[ev.GetNodeId()]
	if !ok {
		return
	}
	if replayed(ev) {
		rn.running[ev.GetNodeId()] = keepLatest(kept, ev)
	}
	if d := ev.GetText(); d != nil {
		rn.keepText(ev.GetNodeId(), ev.GetAt(), d)
	}
	rn.publish(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_NodeEvent{NodeEvent: ev}})
}

// replayed reports whether a subscriber that arrives late is sent the latest event of
// ev's kind of each running node: a kind that says where a node is, each event
// replacing the one before (progress), is; a kind that adds to what came before
// (a delta) cannot be replayed by its latest alone, and is not.
func replayed(ev *meshv1.NodeEvent) bool {
	switch ev.GetKind().(type) {
	case *meshv1.NodeEvent_Progress:
		return true
	default:
		return false
	}
}

// keepLatest replaces the event of ev's kind in kept with ev, or adds it.
func keepLatest(kept []*meshv1.NodeEvent, ev *meshv1.NodeEvent) []*meshv1.NodeEvent {
	kind := reflect.TypeOf(ev.GetKind())
	for i, k := range kept {
		if reflect.TypeOf(k.GetKind()) == kind {
			kept[i] = ev
			return kept
		}
	}
	return append(kept, ev)
}

// keptText is the latest text of a running model node: text follows offset bytes of
// the node's text and ends where its latest delta ended.
type keptText struct {
	offset int64
	text   string
	at     *timestamppb.Timestamp // the latest delta's
}

// keepText adds delta d of node id, sent at at, to the text kept for late subscribers,
// within maxNodeText and maxRunText, under rn.mu. Kept text is always one piece that
// ends at the node's latest delta: a delta that does not follow it (one lost on the way)
// starts the piece again.
func (rn *run) keepText(id string, at *timestamppb.Timestamp, d *meshv1.TextDelta) {
	kt := rn.text[id]
	if kt == nil {
		kt = &keptText{}
		if rn.text == nil {
			rn.text = map[string]*keptText{}
		}
		rn.text[id] = kt
	}
	rn.textBytes -= len(kt.text)
	if kt.text == "" || kt.offset+int64(len(kt.text)) != d.GetOffset() {
		kt.offset, kt.text = d.GetOffset(), d.GetText()
	} else {
		kt.text += d.GetText()
	}
	kt.at = at
	if cut := len(kt.text) - maxNodeText; cut > 0 {
		for cut < len(kt.text) && !utf8.RuneStart(kt.text[cut]) { // whole characters
			cut++
		}
		kt.offset += int64(cut)
		kt.text = strings.Clone(kt.text[cut:])
	}
	if rn.textBytes+len(kt.text) > maxRunText {
		kt.offset, kt.text = 0, ""
	}
	rn.textBytes += len(kt.text)
}

// detail is what a subscriber is sent of a run's events between its started event and
// its summary (RunRequest.events).
type detail int8

const (
	detailNone  detail = iota // nothing (RUN_EVENTS_SUMMARY): no subscription is made
	detailNodes               // node updates (RUN_EVENTS_NODES)
	detailAll                 // node updates and node events (RUN_EVENTS_ALL, the default)
)

// detailOf is the detail a request's events field asks for.
func detailOf(e orchestratorv1.RunEvents) (detail, error) {
	switch e {
	case orchestratorv1.RunEvents_RUN_EVENTS_UNSPECIFIED, orchestratorv1.RunEvents_RUN_EVENTS_ALL:
		return detailAll, nil
	case orchestratorv1.RunEvents_RUN_EVENTS_NODES:
		return detailNodes, nil
	case orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY:
		return detailNone, nil
	}
	return detailAll, status.Errorf(codes.InvalidArgument, "events: %d is not a RunEvents value", e)
}

// events is d as a request's events field.
func (d detail) events() orchestratorv1.RunEvents {
	switch d {
	case detailNone:
		return orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY
	case detailNodes:
		return orchestratorv1.RunEvents_RUN_EVENTS_NODES
	}
	return orchestratorv1.RunEvents_RUN_EVENTS_ALL
}

// publish sends ev to every subscriber that asked for its kind, under rn.mu. A slow
// subscriber loses node events (progress, text) once its buffer is half full, so that
// the room left keeps the node updates its tree is drawn from.
func (rn *run) publish(ev *orchestratorv1.RunResponse) {
	_, isEvent := ev.GetEvent().(*orchestratorv1.RunResponse_NodeEvent)
	for c, d := range rn.subs {
		if isEvent && (d < detailAll || len(c) >= cap(c)/2) {
			continue
		}
		select {
		case c <- ev:
		default: // slow subscriber: drop progress, the summary carries everything
		}
	}
}

// subscribe returns a channel of the run's events of detail d from now on; nil for
// detailNone, which is sent nothing. With detailAll it is led by the replay of the latest
// replayed events of the nodes running now and the text kept of each, as one TextDelta
// (in node order, as many as fit).
func (rn *run) subscribe(d detail) chan *orchestratorv1.RunResponse {
	if d == detailNone {
		return nil
	}
	c := make(chan *orchestratorv1.RunResponse, eventBuffer)
	rn.mu.Lock()
	ids := slices.Sorted(maps.Keys(rn.running))
	if d < detailAll {
		ids = nil
	}
replay:
	for _, id := range ids {
		for _, ev := range rn.running[id] {
			if len(c) == cap(c)/2 { // room left for what comes next
				break replay
			}
			c <- &orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_NodeEvent{NodeEvent: ev}}
		}
		if kt := rn.text[id]; kt != nil && kt.text != "" {
			if len(c) == cap(c)/2 {
				break replay
			}
			c <- &orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_NodeEvent{NodeEvent: &meshv1.NodeEvent{
				NodeId: id, At: kt.at, Kind: &meshv1.NodeEvent_Text{Text: &meshv1.TextDelta{Text: kt.text, Offset: kt.offset}}}}}
		}
	}
	if rn.subs == nil {
		rn.subs = map[chan *orchestratorv1.RunResponse]detail{}
	}
	rn.subs[c] = d
	rn.mu.Unlock()
	return c
}

func (rn *run) unsubscribe(c chan *orchestratorv1.RunResponse) {
	if c == nil {
		return
	}
	rn.mu.Lock()
	delete(rn.subs, c)
	if len(rn.subs) == 0 {
		rn.subs = nil // a detached run outlives its last client: hold no map for it
	}
	rn.mu.Unlock()
}

// ended reports whether the run has ended here (done is closed).
func (rn *run) ended() bool {
	select {
	case <-rn.done:
		return true
	default:
		return false
	}
}

// snapshot copies the run's record with the epoch it is reported at (see epochOf).
func (rn *run) snapshot(shared bool) *orchestratorv1.Run {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	r := proto.Clone(rn.rec).(*orchestratorv1.Run)
	r.Epoch = epochOf(rn.lease.Epoch, shared)
	return r
}

// epochOf is the epoch a run is reported at: its lease's, on a store other orchestrators
// share; 0 on a process-private one, where no run is ever claimed by anyone else (the
// API documents 0 "without a durable store").
func epochOf(epoch int64, shared bool) int64 {
	if !shared {
		return 0
	}
	return epoch
}

func (rn *run) leaseNow() store.Lease {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	return rn.lease
}

// lose stops advancing the run: another owner has it. No cancel broadcast: the nodes the
// executors run under this run's ids may be the new owner's.
func (rn *run) lose() {
	rn.mu.Lock()
	if rn.lost || rn.finishing {
		rn.mu.Unlock()
		return
	}
	rn.lost = true
	rn.mu.Unlock()
	rn.cancel(errLeaseLost)
}

// handOver stops advancing the run so that its lease can be released. It reports false
// when the run's result is already being committed: that run ends here.
func (rn *run) handOver() bool {
	rn.mu.Lock()
	if rn.finishing {
		rn.mu.Unlock()
		return false
	}
	rn.handover = true
	rn.mu.Unlock()
	rn.cancel(errHandover)
	return true
}

// resultUnstored reports whether the run ended here but its result is not stored yet.
func (rn *run) resultUnstored() bool {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	return rn.unstored
}

// moved reports whether the run was lost or handed over.
func (rn *run) moved() bool {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	return rn.lost || rn.handover
}

// movedErr is the status a Run stream ends with when its run moved to another
// orchestrator, nil otherwise.
func (rn *run) movedErr() error {
	if !rn.moved() {
		return nil
	}
	return status.Errorf(codes.Unavailable, "run %s moved to another orchestrator; follow it with WatchRun", rn.id)
}

// The table of this process's runs: s.runs by id, s.order their ids sorted (UUIDv7:
// creation order), which ListRuns pages by.

func (s *Server) add(rn *run) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if l, ok := s.startingRuns[rn.id]; ok {
		// The run's start ends here. If this process's takeover scan claimed it while
		// the store was slow to record it (resume), it goes on under that newer lease.
		delete(s.startingRuns, rn.id)
		if l != nil && l.Epoch > rn.lease.Epoch {
			rn.lease = *l
		}
	}
	if _, ok := s.runs[rn.id]; !ok {
		// Keep order sorted by id; ids minted concurrently may arrive here a little out
		// of order. A run of an id already here (resumed after it moved) replaces the
		// old one and keeps its place.
		i := sort.SearchStrings(s.order, rn.id)
		s.order = append(s.order, "")
		copy(s.order[i+1:], s.order[i:])
		s.order[i] = rn.id
	}
	s.runs[rn.id] = rn
	// Forget the oldest ended runs beyond MaxRuns; running runs are never forgotten, so a
	// long detached run does not stop older ended ones from being dropped.
	excess := len(s.order) - s.cfg.MaxRuns
	if excess <= 0 {
		return
	}
	kept := s.order[:0]
	for _, id := range s.order {
		if rn := s.runs[id]; excess > 0 && rn.ended() && !rn.resultUnstored() {
			delete(s.runs, id)
			excess--
			if !s.shared {
				s.drops = append(s.drops, runRef{tenant: rn.rec.GetTenant(), id: id})
			}
			continue
		}
		kept = append(kept, id)
	}
	s.order = kept
	if len(s.drops) > 0 && !s.dropping {
		s.dropping = true
		s.wg.Add(1)
		go s.dropForgotten()
	}
}

// runRef names a run in the store.
type runRef struct{ tenant, id string }

// dropForgotten deletes the runs forgotten beyond MaxRuns from a process-private store,
// one at a time on one goroutine until none is left, so that the store stays as bounded
// as the table and a forgotten run's idempotency key starts a new run. A shared store
// keeps them: other orchestrators read its runs.
func (s *Server) dropForgotten() {
	defer s.wg.Done()
	for {
		s.mu.Lock()
		refs := s.drops
		s.drops = nil
		if len(refs) == 0 {
			s.dropping = false
		}
		s.mu.Unlock()
		if len(refs) == 0 {
			return
		}
		for _, r := range refs {
			ctx, stop := context.WithTimeout(context.Background(), storeTimeout)
			err := s.cfg.Store.DeleteRun(ctx, r.tenant, r.id)
			stop()
			if err != nil && !errors.Is(err, store.ErrNotFound) {
				s.cfg.Log.Warn("could not delete a run forgotten beyond MaxRuns from the private store",
					"run_id", r.id, "error", err.Error())
			}
		}
	}
}

// forget drops a run from this process's memory, unless another run of the same id
// (resumed here after it moved) has replaced it.
func (s *Server) forget(rn *run) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.runs[rn.id] != rn {
		return
	}
	delete(s.runs, rn.id)
	if i, ok := slices.BinarySearch(s.order, rn.id); ok {
		s.order = slices.Delete(s.order, i, i+1)
	}
}

func (s *Server) get(id string) (*run, error) {
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "run_id is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rn := s.runs[id]
	if rn == nil {
		return nil, status.Errorf(codes.NotFound, "run %q not found", id)
	}
	return rn, nil
}

// visible returns the run this process holds if it belongs to the caller's tenant
// (md.IdentityFrom: authenticated by the server chain). Another tenant's run is
// NOT_FOUND, exactly like a run that does not exist, so that its existence does not leak.
func (s *Server) visible(ctx context.Context, id string) (*run, error) {
	rn, err := s.get(id)
	if err != nil {
		return nil, err
	}
	if rn.rec.GetTenant() != md.IdentityFrom(ctx).Tenant { // rec's tenant is set once, at creation
		return nil, status.Errorf(codes.NotFound, "run %q not found", id)
	}
	return rn, nil
}

// unstored returns the runs that ended here but whose result is not stored yet.
func (s *Server) unstored() []*run {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*run
	for _, rn := range s.runs {
		if rn.resultUnstored() {
			out = append(out, rn)
		}
	}
	return out
}

// live returns the runs of this process that have not ended.
func (s *Server) live() []*run {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*run
	for _, rn := range s.runs {
		if !rn.ended() {
			out = append(out, rn)
		}
	}
	return out
}

// creating notes that this process is recording the new run id (createRun) and will
// launch it: until add, a takeover scan that claims the run (its lease lapsed while the
// store was slow) hands its lease to the start instead of launching the run a second
// time (resume). done ends the note when the start fails before add.
func (s *Server) creating(id string) (done func()) {
	s.mu.Lock()
	s.startingRuns[id] = nil
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		delete(s.startingRuns, id)
		s.mu.Unlock()
	}
}

// claimedWhileStarting reports whether run id is one this process is still starting
// and, if so, keeps l, the lease a takeover scan just claimed it under, for add.
func (s *Server) claimedWhileStarting(id string, l store.Lease) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.startingRuns[id]; !ok {
		return false
	}
	s.startingRuns[id] = &l
	return true
}
