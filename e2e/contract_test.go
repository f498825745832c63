package e2e

import (
	"context"
	"errors"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// headerCase is one curfew-* header value sent to a hop; bad names the header the refusal
// must name, "" when the value is well-formed and the call must be served.
type headerCase struct {
	name string
	kv   []string
	bad  string
}

// headerCases are the malformed values of each rule in docs/api.md and the well-formed
// values at its edges.
func headerCases() []headerCase {
	rid := uuid.NewString
	return []headerCase{
		{"deadline word", []string{md.Deadline, "yesterday"}, md.Deadline},
		{"deadline seconds", []string{md.Deadline, strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)}, md.Deadline},
		{"deadline negative", []string{md.Deadline, "-1"}, md.Deadline},
		{"deadline twice", []string{md.Deadline, "9999999999999", md.Deadline, "9999999999998"}, md.Deadline},
		{"retry-id path", []string{md.RetryID, "../../etc"}, md.RetryID},
		{"retry-id long", []string{md.RetryID, strings.Repeat("r", md.MaxIDLen+1)}, md.RetryID},
		{"attempt negative", []string{md.RetryID, rid(), md.Attempt, "-1"}, md.Attempt},
		{"attempt huge", []string{md.RetryID, rid(), md.Attempt, "99999999999999999999"}, md.Attempt},
		{"attempt zero", []string{md.RetryID, rid(), md.Attempt, "0"}, md.Attempt},
		{"hedge true", []string{md.RetryID, rid(), md.Hedge, "true"}, md.Hedge},
		{"run-id path", []string{md.RunID, "a/b"}, md.RunID},
		{"node-id dotdot", []string{md.NodeID, "root/../.."}, md.NodeID},
		{"tenant spaces", []string{md.Tenant, "tenant with spaces"}, md.Tenant},
		{"key space", []string{md.IdempotencyKey, "a key"}, md.IdempotencyKey},
		{"key long", []string{md.IdempotencyKey, strings.Repeat("k", md.MaxIdempotencyKeyLen+1)}, md.IdempotencyKey},

		{"deadline far", []string{md.Deadline, strconv.FormatInt(md.MaxDeadlineMS, 10)}, ""},
		// Well-formed but long past: the clock-skew rule keeps grpc-timeout.
		{"deadline past", []string{md.Deadline, strconv.FormatInt(md.MinDeadlineMS, 10)}, ""},
		{"retry-id uuid, attempt 1", []string{md.RetryID, rid(), md.Attempt, "1"}, ""},
		{"retry-id longest, attempt max", []string{md.RetryID, strings.Repeat("r", md.MaxIDLen-36) + rid(), md.Attempt, strconv.Itoa(md.MaxAttempt)}, ""},
		{"tenant longest", []string{md.Tenant, strings.Repeat("t", md.MaxTenantLen)}, ""},
		{"key longest", []string{md.IdempotencyKey, strings.Repeat("k", md.MaxIdempotencyKeyLen-36) + rid()}, ""},
	}
}

// checkRefusal fails t unless err is INVALID_ARGUMENT naming header (bad != ""), or nil.
func checkRefusal(t *testing.T, what string, err error, bad string) {
	t.Helper()
	switch {
	case bad == "" && err != nil:
		t.Errorf("%s: a well-formed value was refused: %v", what, err)
	case bad != "" && status.Code(err) != codes.InvalidArgument:
		t.Errorf("%s: %v, want INVALID_ARGUMENT naming %s", what, err, bad)
	case bad != "" && !strings.Contains(status.Convert(err).Message(), bad):
		t.Errorf("%s: the refusal does not name %s: %v", what, bad, err)
	}
}

// The strict wire contract: the orchestrator, called over TLS with a tenant's API key, refuses each
// malformed curfew-* header with INVALID_ARGUMENT naming it, on Run and on StartRun, and
// starts no run; each well-formed edge value starts its run.
func TestContractOrchestratorRefusesMalformedHeaders(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tenant := "contract-" + uuid.NewString()[:8]
	ext := newExternal(t, tenantKey(ctx, t, tenant, false))
	const task = `{"steps": [{"answer_tokens": 1}]}`
	accepted := 0
	for _, tc := range headerCases() {
		cctx, stop := context.WithTimeout(metadata.AppendToOutgoingContext(ctx, tc.kv...), 30*time.Second)
		st, err := ext.orch.Run(cctx, &orchestratorv1.RunRequest{Task: task})
		if err == nil {
			for err == nil {
				_, err = st.Recv()
			}
			if errors.Is(err, io.EOF) {
				err = nil
			}
		}
		checkRefusal(t, "Run, "+tc.name, err, tc.bad)
		_, err = ext.orch.StartRun(cctx, &orchestratorv1.StartRunRequest{Task: task, Timeout: durationpb.New(20 * time.Second)})
		checkRefusal(t, "StartRun, "+tc.name, err, tc.bad)
		stop()
		if tc.bad == "" {
			accepted += 2
		}
	}
	runs, err := ext.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{PageSize: 500})
	if err != nil {
		t.Fatal(err)
	}
	if got := len(runs.GetRuns()); got != accepted {
		t.Errorf("tenant %s has %d runs, want %d (one per accepted call, none per refused one)", tenant, got, accepted)
	}
}

// The strict wire contract: a leaf service (toolrunner), called as a mesh peer, refuses each malformed
// curfew-* header with INVALID_ARGUMENT naming it and records no node; each well-formed
// edge value runs its tool.
func TestContractLeafRefusesMalformedHeaders(t *testing.T) {
	t.Parallel()
	requireTLS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cc, err := mesh.ConnAs(meshtls.Orchestrator, "toolrunner")
	if err != nil {
		t.Fatal(err)
	}
	tools := toolrunnerv1.NewToolRunnerServiceClient(cc)
	reports, err := mesh.Report("toolrunner")
	if err != nil {
		t.Fatal(err)
	}
	for i, tc := range headerCases() {
		run := "e2e-contract-" + uuid.NewString()
		kv := append([]string{md.NodeID, "root/s0.t0"}, tc.kv...)
		if tc.bad != md.RunID {
			kv = append(kv, md.RunID, run)
		}
		if tc.bad == md.NodeID {
			kv = kv[2:] // the case's own node id only
		}
		cctx, stop := context.WithTimeout(metadata.AppendToOutgoingContext(ctx, kv...), 20*time.Second)
		st, err := tools.Execute(cctx, &toolrunnerv1.ExecuteRequest{Name: "sleep", ArgsJson: `{"ms": 1}`})
		for err == nil {
			_, err = st.Recv()
		}
		if errors.Is(err, io.EOF) {
			err = nil
		}
		stop()
		checkRefusal(t, "Execute, "+tc.name, err, tc.bad)
		if tc.bad == "" || tc.bad == md.RunID {
			continue
		}
		nodes, err := reports.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: run})
		if err != nil {
			t.Fatalf("case %d: ListNodes: %v", i, err)
		}
		if n := len(nodes.GetNodes()); n != 0 {
			t.Errorf("Execute, %s: the refused call recorded %d nodes", tc.name, n)
		}
	}
}
