package e2e

import (
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
)

// operatorKey makes an API key with an operator scope through `curfew tenant create
// --scope`, which calls the admin API as curfew-cli.
func operatorKey(ctx context.Context, t *testing.T, tenant, scope string) string {
	t.Helper()
	out, err := exec.CommandContext(ctx, filepath.Join(mesh.Bin, "curfew"), "tenant", "create", tenant, "--scope", scope,
		"--reason", "e2e operator", "--data-dir", mesh.Dir, "--json").Output()
	if err != nil {
		t.Fatalf("curfew tenant create --scope %s: %v", scope, err)
	}
	var k struct {
		Key    string   `json:"key"`
		Scopes []string `json:"scopes"`
	}
	if err := json.Unmarshal(out, &k); err != nil || k.Key == "" || len(k.Scopes) != 1 || k.Scopes[0] != scope {
		t.Fatalf("curfew tenant create --scope %s printed %s (%v)", scope, out, err)
	}
	return k.Key
}

// adminConn dials the orchestrator from outside the mesh (no certificate) with key.
func adminConn(t *testing.T, key string) *grpc.ClientConn {
	t.Helper()
	var opts []grpc.DialOption
	if key != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(apikey.Bearer(key)))
	}
	cc, err := mesh.ConnWith("orchestrator", tlsCreds(t, requireTLS(t), nil), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return cc
}

// callEmpty calls method with an empty request and returns the call's error.
func callEmpty(ctx context.Context, t *testing.T, cc *grpc.ClientConn, m protoreflect.MethodDescriptor) error {
	t.Helper()
	full := adminPrefix + string(m.Name())
	in, err := protoregistry.GlobalTypes.FindMessageByName(m.Input().FullName())
	if err != nil {
		t.Fatal(err)
	}
	outT, err := protoregistry.GlobalTypes.FindMessageByName(m.Output().FullName())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if !m.IsStreamingServer() {
		return cc.Invoke(ctx, full, in.New().Interface(), outT.New().Interface())
	}
	s, err := cc.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, full)
	if err != nil {
		return err
	}
	if err := s.SendMsg(in.New().Interface()); err != nil {
		return err
	}
	if err := s.CloseSend(); err != nil {
		return err
	}
	return s.RecvMsg(outT.New().Interface())
}

// The admin API: a tenant's key is refused every method and changes nothing; the
// read-only scope calls exactly the methods that change nothing; a caller with neither
// a key nor a certificate is unauthenticated; an admin key's changes are audited with
// its key id; runs record who started them; curfew usage matches the ledger.
func TestAdminScopes(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tag := uuid.NewString()[:8]
	tenant := "adm-" + tag
	tenantK := tenantKey(ctx, t, tenant, false)
	readK := operatorKey(ctx, t, "ops-"+tag, "read-only")
	adminK := operatorKey(ctx, t, "ops-"+tag, "admin")
	began := time.Now().Add(-time.Second)

	methods := adminv1.File_curfew_admin_v1_admin_proto.Services().ByName("AdminService").Methods()
	tenantCC, readCC, anonCC := adminConn(t, tenantK), adminConn(t, readK), adminConn(t, "")
	reads := 0
	for i := range methods.Len() {
		m := methods.Get(i)
		full := adminPrefix + string(m.Name())
		if err := callEmpty(ctx, t, tenantCC, m); status.Code(err) != codes.PermissionDenied {
			t.Errorf("%s with a tenant's key: %v, want PERMISSION_DENIED", full, err)
		}
		if err := callEmpty(ctx, t, anonCC, m); status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s without key or certificate: %v, want UNAUTHENTICATED", full, err)
		}
		err := callEmpty(ctx, t, readCC, m)
		if changesNothing(m) {
			reads++
			if c := status.Code(err); c == codes.PermissionDenied || c == codes.Unauthenticated {
				t.Errorf("%s (changes nothing) with the read-only scope: %v, want it admitted", full, err)
			}
		} else if status.Code(err) != codes.PermissionDenied {
			t.Errorf("%s (changes something) with the read-only scope: %v, want PERMISSION_DENIED", full, err)
		}
	}
	if reads == 0 || reads == methods.Len() {
		t.Fatalf("%d of %d methods are read-only: the descriptor's idempotency levels are not set", reads, methods.Len())
	}

	// An admin key changes something, and the audit log says who; the refused calls
	// left no trace.
	adm := adminv1.NewAdminServiceClient(adminConn(t, adminK))
	made, err := adm.CreateKey(ctx, &adminv1.CreateKeyRequest{Tenant: tenant, Reason: "second key for " + tenant})
	if err != nil || !strings.HasPrefix(made.GetSecret(), apikey.Prefix) || made.GetKey().GetTenant() != tenant {
		t.Fatalf("CreateKey with the admin key: %v, %v", made, err)
	}
	if _, err := adm.RevokeKey(ctx, &adminv1.RevokeKeyRequest{Id: made.GetKey().GetId(), Reason: "not needed"}); err != nil {
		t.Fatal(err)
	}
	audit, err := adm.ListAudit(ctx, &adminv1.ListAuditRequest{Since: timestamppb.New(began), PageSize: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var mine []string
	for _, e := range audit.GetEntries() {
		switch e.GetActor() {
		case "key:" + apikey.ID(tenantK), "key:" + apikey.ID(readK):
			t.Errorf("a refused caller left an audit entry: %v", e)
		case "key:" + apikey.ID(adminK):
			mine = append(mine, e.GetAction()+" "+e.GetTarget()+" ("+e.GetReason()+")")
		}
	}
	want := []string{ // newest first
		"RevokeKey key " + made.GetKey().GetId() + " of tenant " + tenant + " (not needed)",
		"CreateKey tenant " + tenant + " (second key for " + tenant + ")",
	}
	if strings.Join(mine, "|") != strings.Join(want, "|") {
		t.Errorf("audit entries of the admin key: %q, want %q", mine, want)
	}
	// The CLI's own changes are audited as curfew-cli.
	found := false
	for _, e := range audit.GetEntries() {
		if e.GetActor() == "mesh:curfew-cli" && e.GetAction() == "CreateKey" && e.GetTarget() == "tenant ops-"+tag && e.GetReason() == "e2e operator" {
			found = true
		}
	}
	if !found {
		t.Errorf("no audit entry of curfew-cli creating the operator keys in %v", audit.GetEntries())
	}

	// Runs record who started them, and curfew usage adds up what the runs spent.
	ext := newExternal(t, tenantK)
	var prompt, output int64
	for _, plan := range []string{
		`{"tokens_per_second": 500, "steps": [{"answer_tokens": 3}]}`,
		`{"tokens_per_second": 500, "steps": [{"tools": [{"name": "sleep", "args": {"ms": 5}}]}, {"answer_tokens": 4}]}`,
	} {
		res, _ := runPlan(ctx, ext.orch, plan, 20*time.Second, 0, false)
		if res.err != nil {
			t.Fatalf("run: %v", res.err)
		}
		if got := res.finished.GetStartedBy(); got != "key:"+apikey.ID(tenantK) {
			t.Errorf("run %s started_by %q, want key:%s", res.finished.GetRunId(), got, apikey.ID(tenantK))
		}
		prompt += res.finished.GetPromptTokens()
		output += res.finished.GetTokens() + res.finished.GetTokensAfterCancel()
	}
	if output == 0 {
		t.Fatal("the runs spent no tokens")
	}
	var last string
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := exec.CommandContext(ctx, filepath.Join(mesh.Bin, "curfew"), "usage", "--tenant", tenant, "--data-dir", mesh.Dir, "--json").Output()
		if err != nil {
			t.Fatalf("curfew usage: %v", err)
		}
		var u adminv1.UsageResponse
		if err := protojson.Unmarshal(out, &u); err != nil {
			t.Fatalf("curfew usage printed %s: %v", out, err)
		}
		if len(u.GetTenants()) == 1 {
			g := u.GetTenants()[0]
			if g.GetTenant() == tenant && g.GetRuns() == 2 && g.GetOutputTokens() == output && g.GetPromptTokens() == prompt {
				break
			}
		}
		last = string(out)
		if time.Now().After(deadline) {
			t.Fatalf("curfew usage --tenant %s = %s; want 2 runs, %d output and %d prompt tokens", tenant, last, output, prompt)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

const adminPrefix = "/curfew.admin.v1.AdminService/"

// changesNothing reads a method's idempotency level, the descriptor's word for it.
func changesNothing(m protoreflect.MethodDescriptor) bool {
	o, ok := m.Options().(*descriptorpb.MethodOptions)
	return ok && o.GetIdempotencyLevel() == descriptorpb.MethodOptions_NO_SIDE_EFFECTS
}
