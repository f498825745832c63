package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// scopeList is a repeatable --scope flag.
type scopeList []string

func (s *scopeList) String() string { return strings.Join(*s, ",") }

func (s *scopeList) Set(v string) error {
	switch v {
	case store.ScopeAdmin, store.ScopeReadOnly:
		*s = append(*s, v)
		return nil
	}
	return fmt.Errorf("%q is not a scope: admin or read-only", v)
}

var scopeProtos = map[string]adminv1.Scope{store.ScopeAdmin: adminv1.Scope_SCOPE_ADMIN, store.ScopeReadOnly: adminv1.Scope_SCOPE_READ_ONLY}

// adminClient dials the orchestrator's admin API.
func (c *common) adminClient() (adminv1.AdminServiceClient, func(), error) {
	conn, err := c.dial()
	if err != nil {
		return nil, nil, err
	}
	return adminv1.NewAdminServiceClient(conn), func() { _ = conn.Close() }, nil
}

func keyOf(k *adminv1.APIKey) store.APIKey {
	out := store.APIKey{ID: k.GetId(), Tenant: k.GetTenant(), CreatedAt: k.GetCreatedAt().AsTime()}
	if k.RevokedAt != nil {
		out.RevokedAt = k.GetRevokedAt().AsTime()
	}
	for _, sc := range k.GetScopes() {
		for name, p := range scopeProtos {
			if p == sc {
				out.Scopes = append(out.Scopes, name)
			}
		}
	}
	return out
}

// subcommand splits args into a subcommand of subs and its arguments, printing usage
// for help. ok is false when the command is done (exit code given).
func subcommand(cmd, text string, subs []string, args []string, stdout, stderr io.Writer) (sub string, rest []string, code int, ok bool) {
	if len(args) == 0 {
		return "", nil, usageErr(stderr, cmd, fmt.Errorf("give a subcommand: %s\n\n%s", strings.Join(subs, " or "), strings.TrimSuffix(text, "\n"))), false
	}
	switch args[0] {
	case "help", "-h", "--help":
		fmt.Fprint(stdout, text)
		return "", nil, ExitOK, false
	}
	for _, s := range subs {
		if args[0] == s {
			return s, args[1:], 0, true
		}
	}
	return "", nil, usageErr(stderr, cmd, fmt.Errorf("unknown subcommand %q\n\n%s", args[0], strings.TrimSuffix(text, "\n"))), false
}

// durationFlag reads a duration flag's value: "" is unset (nil).
func durationFlag(name, v string) (*durationpb.Duration, error) {
	if v == "" {
		return nil, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return nil, fmt.Errorf("--%s %q: give a positive duration (90s, 5m)", name, v)
	}
	return durationpb.New(d), nil
}

// adminCall dials the admin API and runs call with a bounded context (callTimeout).
func adminCall(ctx context.Context, c *common, stderr io.Writer, what string, call func(context.Context, adminv1.AdminServiceClient) error) int {
	return adminCallFor(ctx, c, stderr, what, callTimeout, call)
}

// adminCallFor is adminCall bounded by timeout, for a call that waits (pool reopen).
func adminCallFor(ctx context.Context, c *common, stderr io.Writer, what string, timeout time.Duration, call func(context.Context, adminv1.AdminServiceClient) error) int {
	client, closeConn, err := c.adminClient()
	if err != nil {
		return callErr(stderr, "dial", err)
	}
	defer closeConn()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := call(ctx, client); err != nil {
		return callErr(stderr, what, err)
	}
	return ExitOK
}

// tenantViaAPI runs a tenant subcommand through the admin API.
func tenantViaAPI(ctx context.Context, c *common, sub, arg string, scopes []string, reason string, stdout, stderr io.Writer) int {
	client, closeConn, err := c.adminClient()
	if err != nil {
		return callErr(stderr, "dial", err)
	}
	defer closeConn()
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	switch sub {
	case "create", "rotate-key":
		req := &adminv1.CreateKeyRequest{Tenant: arg, RevokeOthers: sub == "rotate-key", Reason: reason}
		for _, s := range scopes {
			req.Scopes = append(req.Scopes, scopeProtos[s])
		}
		resp, err := client.CreateKey(ctx, req)
		if err != nil {
			return callErr(stderr, "tenant "+sub, err)
		}
		return printNewKey(stdout, keyOf(resp.GetKey()), resp.GetSecret(), resp.GetRevoked(), sub == "rotate-key", c.json)
	case "revoke":
		resp, err := client.RevokeKey(ctx, &adminv1.RevokeKeyRequest{Id: arg, Reason: reason})
		if err != nil {
			return callErr(stderr, "tenant revoke", err)
		}
		return printRevoked(stdout, keyOf(resp.GetKey()), c.json)
	default: // ls
		resp, err := client.ListKeys(ctx, &adminv1.ListKeysRequest{Tenant: arg})
		if err != nil {
			return callErr(stderr, "tenant ls", err)
		}
		keys := make([]store.APIKey, 0, len(resp.GetKeys()))
		for _, k := range resp.GetKeys() {
			keys = append(keys, keyOf(k))
		}
		return printKeys(stdout, keys, c.json)
	}
}

const auditUsage = `Usage:
  curfew audit ls [--since D|TIME] [--limit N] [--json]

Every operator call that changed something (pools, leases, freezes, drains, keys,
approvals), newest first: when, who (key:<id> or mesh:<identity>), what, on what, why.
--since takes a duration back from now (1h) or an RFC 3339 time.
`

func cmdAudit(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != "ls" {
		if len(args) > 0 && (args[0] == "help" || args[0] == "-h" || args[0] == "--help") {
			fmt.Fprint(stdout, auditUsage)
			return ExitOK
		}
		return usageErr(stderr, "audit", errors.New("give the subcommand ls\n\n"+strings.TrimSuffix(auditUsage, "\n")))
	}
	fs := newFlags("audit ls", stderr)
	var c common
	c.register(fs)
	sinceFlag := fs.String("since", "", "only entries since this long ago (1h) or this RFC 3339 time")
	limit := fs.Int("limit", 100, "most entries to list")
	pos, err := parse(fs, args[1:])
	if err != nil {
		return usageErr(stderr, "audit ls", err)
	}
	if len(pos) != 0 || *limit < 1 {
		return usageErr(stderr, "audit ls", errors.New("takes no arguments, and --limit must be at least 1"))
	}
	since, err := parseSince(*sinceFlag)
	if err != nil {
		return usageErr(stderr, "audit ls", err)
	}
	client, closeConn, err := c.adminClient()
	if err != nil {
		return callErr(stderr, "dial", err)
	}
	defer closeConn()
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	req := &adminv1.ListAuditRequest{Since: since, PageSize: int32(min(*limit, 1000))} //nolint:gosec // bounded above
	var entries []*adminv1.AuditEntry
	for len(entries) < *limit {
		resp, err := client.ListAudit(ctx, req)
		if err != nil {
			return callErr(stderr, "audit ls", err)
		}
		entries = append(entries, resp.GetEntries()...)
		if resp.GetNextPageToken() == "" {
			break
		}
		req.PageToken = resp.GetNextPageToken()
	}
	if len(entries) > *limit {
		entries = entries[:*limit]
	}
	if c.json {
		printJSON(stdout, &adminv1.ListAuditResponse{Entries: entries})
		return ExitOK
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "AT\tACTOR\tACTION\tTARGET\tREASON")
	for _, e := range entries {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", e.GetAt().AsTime().UTC().Format(time.RFC3339), e.GetActor(), e.GetAction(), e.GetTarget(), dash(e.GetReason()))
	}
	_ = tw.Flush()
	return ExitOK
}

// cmdUsage prints, per tenant, from the ledger and the run records: prompt and output
// tokens (orphans, the tokens decoded after a cancel or freeze, apart), runs started and
// runs shed.
func cmdUsage(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("usage", stderr)
	var c common
	c.register(fs)
	tenant := fs.String("tenant", "", "one tenant (default: every tenant)")
	sinceFlag := fs.String("since", "", "only since this long ago (24h) or this RFC 3339 time")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "usage", err)
	}
	if len(pos) != 0 {
		return usageErr(stderr, "usage", errors.New("takes no arguments"))
	}
	since, err := parseSince(*sinceFlag)
	if err != nil {
		return usageErr(stderr, "usage", err)
	}
	client, closeConn, err := c.adminClient()
	if err != nil {
		return callErr(stderr, "dial", err)
	}
	defer closeConn()
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	resp, err := client.Usage(ctx, &adminv1.UsageRequest{Tenant: *tenant, Since: since})
	if err != nil {
		return callErr(stderr, "usage", err)
	}
	if c.json {
		printJSON(stdout, resp)
		return ExitOK
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "TENANT\tPROMPT\tOUTPUT\tORPHAN\tRUNS\tSHED\t")
	for _, u := range resp.GetTenants() {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t\n", u.GetTenant(), u.GetPromptTokens(), u.GetOutputTokens(), u.GetOrphanTokens(), u.GetRuns(), u.GetSheds())
	}
	_ = tw.Flush()
	return ExitOK
}

// parseSince reads --since: "" (nil: everything), a duration back from now, or an RFC
// 3339 time.
func parseSince(v string) (*timestamppb.Timestamp, error) { return parseWhen("--since", v) }

// parseWhen reads the value v of the time flag name as --since does.
func parseWhen(name, v string) (*timestamppb.Timestamp, error) {
	if v == "" {
		return nil, nil
	}
	if d, err := time.ParseDuration(v); err == nil {
		if d <= 0 {
			return nil, fmt.Errorf("%s %s: give a positive duration", name, v)
		}
		return timestamppb.New(time.Now().Add(-d)), nil
	}
	t, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return nil, fmt.Errorf("%s %q: give a duration (1h) or an RFC 3339 time", name, v)
	}
	return timestamppb.New(t), nil
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
