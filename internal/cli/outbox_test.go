package cli

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

func TestOutboxLs(t *testing.T) {
	ctx := t.Context()
	dsn := "sqlite://" + filepath.Join(t.TempDir(), "curfew.db")
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	for i, tenant := range []string{"acme", "acme", "globex"} {
		b, err := st.BeginTool(ctx, store.ToolBegin{Tenant: tenant, Key: "call-" + string(rune('a'+i)), Owner: "tr", TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		if err := st.CompleteTool(ctx, b.Claim, nil, store.Notify{Channel: "ops", Payload: []byte("hi")}); err != nil {
			t.Fatal(err)
		}
	}
	l, err := st.ClaimOutboxRelay(ctx, "relay", time.Minute)
	if err == nil {
		err = st.AdvanceOutbox(ctx, l, store.CursorAdvance{Tenant: "acme", Channel: "ops", From: 0, To: 1, StreamSeq: 1, MsgID: "acme/call-a/0"})
	}
	if err != nil {
		t.Fatal(err)
	}
	_ = st.Close()
	run := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := Main(ctx, append([]string{"outbox"}, append(args, "--store", dsn)...), nil, &out, &errb)
		return code, out.String(), errb.String()
	}
	code, out, errs := run("ls")
	if code != ExitOK || !strings.Contains(out, "STATE") || strings.Count(out, "relayed") != 1 || strings.Count(out, "pending") != 2 ||
		!strings.Contains(out, "acme/call-a/0") {
		t.Fatalf("ls: exit %d\n%s%s", code, out, errs)
	}
	code, out, errs = run("ls", "acme", "--pending", "--json")
	var got struct {
		Rows []struct {
			Tenant, Channel, Key, State string
			ChannelSeq                  int64 `json:"channel_seq"`
		}
	}
	if code != ExitOK || json.Unmarshal([]byte(out), &got) != nil || len(got.Rows) != 1 ||
		got.Rows[0].Key != "acme/call-b/0" || got.Rows[0].State != "pending" || got.Rows[0].ChannelSeq != 2 {
		t.Fatalf("ls acme --pending --json: exit %d %q %s", code, out, errs)
	}
	if code, _, _ := run("ls", "a", "b"); code != ExitUsage {
		t.Fatalf("two tenants: exit %d", code)
	}
}
