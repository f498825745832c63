package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// fakeDLQ is a DeadLetterService holding dead letters in memory, newest first, with the
// service's paging and replay semantics; it records the requests it gets. (The real
// DeadLetterServer lives in the orchestrator module's internal package, which this
// module cannot import.)
type fakeDLQ struct {
	orchestratorv1.UnimplementedDeadLetterServiceServer
	mu      sync.Mutex
	dls     []*orchestratorv1.DeadLetter
	maxPage int               // the page size cap, to force paging
	runs    map[string]string // dead letter id → replay run id
	lists   []*orchestratorv1.ListDeadLettersRequest
	replays []*orchestratorv1.ReplayDeadLetterRequest
	purges  []*orchestratorv1.PurgeDeadLettersRequest
}

func (f *fakeDLQ) ListDeadLetters(_ context.Context, req *orchestratorv1.ListDeadLettersRequest) (*orchestratorv1.ListDeadLettersResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lists = append(f.lists, proto.Clone(req).(*orchestratorv1.ListDeadLettersRequest))
	size := int(req.GetPageSize())
	if size == 0 {
		size = 100
	}
	size = min(size, f.maxPage)
	resp := &orchestratorv1.ListDeadLettersResponse{}
	started := req.GetPageToken() == ""
	for _, d := range f.dls {
		if !started {
			started = d.GetId() == req.GetPageToken()
			continue
		}
		if (req.GetRunId() != "" && d.GetRunId() != req.GetRunId()) || (d.GetReplayedAt() != nil && !req.GetIncludeReplayed()) {
			continue
		}
		if len(resp.DeadLetters) == size {
			resp.NextPageToken = resp.DeadLetters[size-1].GetId()
			break
		}
		resp.DeadLetters = append(resp.DeadLetters, d)
	}
	return resp, nil
}

func (f *fakeDLQ) find(id string) (*orchestratorv1.DeadLetter, error) {
	for _, d := range f.dls {
		if d.GetId() == id {
			return d, nil
		}
	}
	return nil, status.Errorf(codes.NotFound, "dead letter %s not found", id)
}

func (f *fakeDLQ) GetDeadLetter(_ context.Context, req *orchestratorv1.GetDeadLetterRequest) (*orchestratorv1.GetDeadLetterResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, err := f.find(req.GetId())
	if err != nil {
		return nil, err
	}
	return &orchestratorv1.GetDeadLetterResponse{DeadLetter: d}, nil
}

func (f *fakeDLQ) ReplayDeadLetter(_ context.Context, req *orchestratorv1.ReplayDeadLetterRequest) (*orchestratorv1.ReplayDeadLetterResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.replays = append(f.replays, proto.Clone(req).(*orchestratorv1.ReplayDeadLetterRequest))
	d, err := f.find(req.GetId())
	if err != nil {
		return nil, err
	}
	if run, ok := f.runs[d.GetId()]; ok {
		return &orchestratorv1.ReplayDeadLetterResponse{DeadLetter: d, RunId: run}, nil
	}
	d.ReplayedAt, d.ReplayCount = timestamppb.Now(), d.GetReplayCount()+1
	f.runs[d.GetId()] = fmt.Sprintf("replay-run-%d", len(f.runs)+1)
	return &orchestratorv1.ReplayDeadLetterResponse{DeadLetter: d, RunId: f.runs[d.GetId()], Created: true}, nil
}

func (f *fakeDLQ) PurgeDeadLetters(_ context.Context, req *orchestratorv1.PurgeDeadLettersRequest) (*orchestratorv1.PurgeDeadLettersResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.purges = append(f.purges, proto.Clone(req).(*orchestratorv1.PurgeDeadLettersRequest))
	var kept []*orchestratorv1.DeadLetter
	for _, d := range f.dls {
		if (req.GetId() == "" || d.GetId() == req.GetId()) && (req.GetBefore() == nil || d.GetCreatedAt().AsTime().Before(req.GetBefore().AsTime())) &&
			(!req.GetOnlyReplayed() || d.GetReplayedAt() != nil) {
			continue
		}
		kept = append(kept, d)
	}
	n := len(f.dls) - len(kept)
	f.dls = kept
	return &orchestratorv1.PurgeDeadLettersResponse{Purged: int64(n)}, nil
}

// fixedNow is the clock of these tests.
var fixedNow = time.Date(2030, 5, 6, 12, 0, 0, 0, time.UTC)

// serveDLQ serves a fake holding n dead letters on loopback: dl-0 is the oldest (n hours
// old), dl-(n-1) the newest (1 hour old); dl-1 has been replayed. It returns the fake and
// the --addr flag to reach it.
func serveDLQ(t *testing.T, n int) (*fakeDLQ, []string) {
	t.Helper()
	old := dlqNow
	dlqNow = func() time.Time { return fixedNow }
	t.Cleanup(func() { dlqNow = old })
	f := &fakeDLQ{maxPage: 2, runs: map[string]string{}}
	for i := n - 1; i >= 0; i-- {
		d := &orchestratorv1.DeadLetter{Id: fmt.Sprintf("dl-%d", i), Tenant: "default", RunId: fmt.Sprintf("run-%d", i%2), Step: "root",
			ErrorType: "unavailable", Attempts: 3, LastError: "modelproxy: connection refused",
			Payload: []byte(`{"task":"t","model":"sim"}`), IdempotencyKey: fmt.Sprintf("key-%d", i),
			CreatedAt: timestamppb.New(fixedNow.Add(-time.Duration(n-i) * time.Hour))}
		if i == 1 {
			d.ReplayedAt, d.ReplayCount = timestamppb.New(fixedNow.Add(-30*time.Minute)), 1
		}
		f.dls = append(f.dls, d)
	}
	conn := meshtest.Serve(t, mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)}, func(gs *grpc.Server) {
		orchestratorv1.RegisterDeadLetterServiceServer(gs, f)
	})
	return f, []string{"--addr", conn.Target()}
}

// curfew runs the command line and returns its exit code, stdout and stderr.
func curfew(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	code := Main(context.Background(), args, nil, &out, &errb)
	return code, out.String(), errb.String()
}

func TestDlqUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		out  string
	}{
		{[]string{"dlq"}, ExitUsage, "curfew dlq: give a subcommand: ls, show, replay or purge"},
		{[]string{"dlq", "peek"}, ExitUsage, `curfew dlq: unknown subcommand "peek"`},
		{[]string{"dlq", "help"}, ExitOK, "curfew dlq replay  ID [--timeout D]"},
		{[]string{"help"}, ExitOK, "curfew dlq     purge (--id ID | --before TIME | --replayed)"},
		{[]string{"dlq", "ls", "extra"}, ExitUsage, "curfew dlq ls: takes no arguments"},
		{[]string{"dlq", "ls", "--limit", "0"}, ExitUsage, "--limit must be at least 1"},
		{[]string{"dlq", "show"}, ExitUsage, "curfew dlq show: give one dead letter ID"},
		{[]string{"dlq", "show", "a", "b"}, ExitUsage, "give one dead letter ID"},
		{[]string{"dlq", "replay"}, ExitUsage, "curfew dlq replay: give one dead letter ID"},
		{[]string{"dlq", "replay", "a", "--timeout", "-1s"}, ExitUsage, "--timeout must not be negative"},
		{[]string{"dlq", "purge"}, ExitUsage, "curfew dlq purge: give at least one of --id, --before and --replayed"},
		{[]string{"dlq", "purge", "a"}, ExitUsage, "takes no arguments"},
		{[]string{"dlq", "purge", "--before", "yesterday"}, ExitUsage, `--before "yesterday"`},
		{[]string{"dlq", "purge", "--before", "-2h"}, ExitUsage, "--before"},
		{[]string{"dlq", "purge", "--bogus"}, ExitUsage, "flag provided but not defined"},
	} {
		code, out, errs := curfew(tc.args...)
		if code != tc.code {
			t.Errorf("%q: exit %d, want %d (stderr %q)", tc.args, code, tc.code, errs)
		}
		if !strings.Contains(out+errs, tc.out) {
			t.Errorf("%q: output %q lacks %q", tc.args, out+errs, tc.out)
		}
	}
}

func TestDlqLs(t *testing.T) {
	f, addr := serveDLQ(t, 5)
	code, out, errs := curfew(append([]string{"dlq", "ls"}, addr...)...)
	if code != ExitOK {
		t.Fatalf("exit %d: %s", code, errs)
	}
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) != 5 {
		t.Fatalf("want a header and the 4 open dead letters, got:\n%s", out)
	}
	if h := strings.Fields(lines[0]); strings.Join(h, " ") != "ID RUN STEP ERROR_TYPE ATTEMPTS AGE REPLAYED" {
		t.Errorf("header %q", lines[0])
	}
	if got := strings.Fields(lines[1]); strings.Join(got, " ") != "dl-4 run-0 root unavailable 3 1h00m -" {
		t.Errorf("newest row %q", lines[1])
	}
	if got := strings.Fields(lines[4]); got[0] != "dl-0" || got[5] != "5h00m" {
		t.Errorf("oldest row %q", lines[4])
	}
	if len(f.lists) != 2 || f.lists[0].GetPageSize() != 50 || f.lists[1].GetPageToken() != "dl-3" || f.lists[0].GetIncludeReplayed() {
		t.Errorf("list requests: %v, want two pages from page size 50, open only", f.lists)
	}

	f.lists = nil
	code, out, _ = curfew(append([]string{"dlq", "ls", "--all", "--run", "run-1", "--limit", "1"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, "dl-3") || strings.Contains(out, "dl-1") {
		t.Errorf("--all --run run-1 --limit 1: exit %d\n%s", code, out)
	}
	if len(f.lists) != 1 || !f.lists[0].GetIncludeReplayed() || f.lists[0].GetRunId() != "run-1" || f.lists[0].GetPageSize() != 1 {
		t.Errorf("list request: %v", f.lists)
	}
	code, out, _ = curfew(append([]string{"dlq", "ls", "--all", "--run", "run-1"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, "dl-1 ") || !strings.Contains(out, "30m ago") {
		t.Errorf("the replayed one shows when: exit %d\n%s", code, out)
	}

	code, out, _ = curfew(append([]string{"dlq", "ls", "--all", "--json"}, addr...)...)
	var v struct {
		DeadLetters []map[string]any `json:"dead_letters"`
	}
	if code != ExitOK || json.Unmarshal([]byte(out), &v) != nil || len(v.DeadLetters) != 5 {
		t.Fatalf("--json: exit %d %s", code, out)
	}
	if d := v.DeadLetters[3]; d["id"] != "dl-1" || d["replayed_at"] == nil || d["run_id"] != "run-1" || d["error_type"] != "unavailable" {
		t.Errorf("--json fields: %v", d)
	}
}

func TestDlqShow(t *testing.T) {
	f, addr := serveDLQ(t, 2)
	code, out, errs := curfew(append([]string{"dlq", "show", "dl-1"}, addr...)...)
	if code != ExitOK {
		t.Fatalf("exit %d: %s", code, errs)
	}
	for _, want := range []string{"id:              dl-1", "tenant:          default", "run:             run-1", "step:            root",
		"error type:      unavailable", "attempts:        3", "last error:      modelproxy: connection refused",
		"idempotency key: key-1", "(1h00m ago)", "(30m ago)", "replay count:    1",
		"payload:\n{\n  \"task\": \"t\",\n  \"model\": \"sim\"\n}\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("show lacks %q:\n%s", want, out)
		}
	}

	f.dls[1].Payload, f.dls[1].ReplayedAt = []byte{0xff, 0x00, 'x'}, nil // dl-0
	code, out, _ = curfew(append([]string{"dlq", "show", "dl-0"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, "payload (base64, 3 bytes):\n/wB4\n") || !strings.Contains(out, "replayed:        -") {
		t.Errorf("binary payload in base64: exit %d\n%s", code, out)
	}

	code, out, _ = curfew(append([]string{"dlq", "show", "dl-0", "--json"}, addr...)...)
	var v map[string]any
	if code != ExitOK || json.Unmarshal([]byte(out), &v) != nil || v["id"] != "dl-0" || v["payload"] != "/wB4" {
		t.Errorf("--json: exit %d %s", code, out)
	}

	code, out, errs = curfew(append([]string{"dlq", "show", "nope"}, addr...)...)
	if code != ExitFail || out != "" || !strings.Contains(errs, "curfew: dlq show: NotFound: dead letter nope not found") {
		t.Errorf("missing: exit %d, stdout %q, stderr %q", code, out, errs)
	}
}

func TestDlqReplay(t *testing.T) {
	f, addr := serveDLQ(t, 1)
	code, out, errs := curfew(append([]string{"dlq", "replay", "dl-0", "--timeout", "90s"}, addr...)...)
	if code != ExitOK || out != "replayed as run replay-run-1\n" {
		t.Fatalf("first replay: exit %d %q %s", code, out, errs)
	}
	code, out, _ = curfew(append([]string{"dlq", "replay", "dl-0"}, addr...)...)
	if code != ExitOK || out != "already replayed as run replay-run-1\n" {
		t.Errorf("second replay: exit %d %q", code, out)
	}
	code, out, _ = curfew(append([]string{"dlq", "replay", "dl-0", "--json"}, addr...)...)
	var v struct {
		RunID      string         `json:"run_id"`
		Created    bool           `json:"created"`
		DeadLetter map[string]any `json:"dead_letter"`
	}
	if code != ExitOK || json.Unmarshal([]byte(out), &v) != nil || v.RunID != "replay-run-1" || v.Created || v.DeadLetter["id"] != "dl-0" {
		t.Errorf("--json: exit %d %s", code, out)
	}
	if len(f.replays) != 3 || f.replays[0].GetTimeout().AsDuration() != 90*time.Second || f.replays[1].GetTimeout() != nil {
		t.Errorf("replay requests: %v, want the timeout only when given", f.replays)
	}
	code, _, errs = curfew(append([]string{"dlq", "replay", "nope"}, addr...)...)
	if code != ExitFail || !strings.Contains(errs, "curfew: dlq replay: NotFound") {
		t.Errorf("missing: exit %d %q", code, errs)
	}
}

func TestDlqPurge(t *testing.T) {
	f, addr := serveDLQ(t, 5)
	code, out, errs := curfew(append([]string{"dlq", "purge", "--id", "dl-4"}, addr...)...)
	if code != ExitOK || out != "purged 1 dead letter\n" {
		t.Fatalf("--id: exit %d %q %s", code, out, errs)
	}
	code, out, _ = curfew(append([]string{"dlq", "purge", "--replayed", "--json"}, addr...)...)
	if code != ExitOK || strings.TrimSpace(out) != `{"purged":"1"}` {
		t.Errorf("--replayed --json: exit %d %q", code, out)
	}
	code, out, _ = curfew(append([]string{"dlq", "purge", "--before", "2h30m"}, addr...)...)
	if code != ExitOK || out != "purged 2 dead letters\n" { // dl-0 and dl-2 (5 and 3 hours old); dl-1 is gone
		t.Errorf("--before 2h30m: exit %d %q", code, out)
	}
	code, out, _ = curfew(append([]string{"dlq", "purge", "--before", "2030-05-06T14:00:00+02:00", "--replayed"}, addr...)...)
	if code != ExitOK || out != "purged 0 dead letters\n" {
		t.Errorf("--before RFC3339 --replayed: exit %d %q", code, out)
	}
	want := []*orchestratorv1.PurgeDeadLettersRequest{
		{Id: "dl-4"},
		{OnlyReplayed: true},
		{Before: timestamppb.New(fixedNow.Add(-2*time.Hour - 30*time.Minute))},
		{Before: timestamppb.New(fixedNow), OnlyReplayed: true},
	}
	if len(f.purges) != len(want) {
		t.Fatalf("purge requests: %v", f.purges)
	}
	for i := range want {
		if !proto.Equal(f.purges[i], want[i]) {
			t.Errorf("purge request %d = %v, want %v", i, f.purges[i], want[i])
		}
	}
}

func TestParseBefore(t *testing.T) {
	now := fixedNow
	for _, tc := range []struct {
		in   string
		want time.Time
	}{
		{"2030-01-02T03:04:05Z", time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)},
		{"2030-01-02T03:04:05.5+01:00", time.Date(2030, 1, 2, 2, 4, 5, 5e8, time.UTC)},
		{"90m", now.Add(-90 * time.Minute)},
		{"72h", now.Add(-72 * time.Hour)},
		{"7d", now.Add(-7 * 24 * time.Hour)},
	} {
		got, err := parseBefore(tc.in, now)
		if err != nil || !got.Equal(tc.want) {
			t.Errorf("parseBefore(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "0s", "-1h", "0d", "-3d", "d", "1.5d", "2030-01-02", "soon"} {
		if _, err := parseBefore(bad, now); err == nil {
			t.Errorf("parseBefore(%q) accepted", bad)
		}
	}
}

func TestAge(t *testing.T) {
	for _, tc := range []struct {
		d    time.Duration
		want string
	}{
		{-time.Second, "0s"}, {45 * time.Second, "45s"}, {12*time.Minute + 59*time.Second, "12m"},
		{3*time.Hour + 5*time.Minute, "3h05m"}, {4*24*time.Hour + 2*time.Hour + time.Minute, "4d02h"},
	} {
		if got := age(fixedNow, timestamppb.New(fixedNow.Add(-tc.d))); got != tc.want {
			t.Errorf("age(%v) = %q, want %q", tc.d, got, tc.want)
		}
	}
	if age(fixedNow, nil) != "-" {
		t.Error("no time: -")
	}
}
