package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

const tenantUsage = `Usage:
  curfew tenant create TENANT      [--scope S]... [--reason R] [--json]   a new API key for TENANT (its other keys stay valid)
  curfew tenant rotate-key TENANT  [--scope S]... [--reason R] [--json]   a new API key; every other key of TENANT is revoked
  curfew tenant revoke KEY_ID      [--reason R] [--json]                  revoke one key
  curfew tenant ls [TENANT]        [--json]                               keys (ids, never secrets), of one tenant or all

A key is shown once, when it is made: the store keeps only its id and a hash of its
secret. Callers send it as metadata authorization: Bearer <key>. --scope admin or
--scope read-only makes an operator's key (docs/operations.md): admin may call every
operator command, read-only only those that change nothing.

These commands call the orchestrator's admin API (as curfew-cli, or with an operator's
$CURFEW_API_KEY), so each change is in the audit log (curfew audit ls). --store DSN
writes to a store directly instead, without a running mesh and without an audit entry:
for the first operator key of a new installation.
`

// tenantTimeout bounds one tenant command's store work.
const tenantTimeout = 30 * time.Second

func cmdTenant(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		return usageErr(stderr, "tenant", errors.New("give a subcommand: create, rotate-key, revoke or ls\n\n"+strings.TrimSuffix(tenantUsage, "\n")))
	}
	sub, args := args[0], args[1:]
	switch sub {
	case "help", "-h", "--help":
		fmt.Fprint(stdout, tenantUsage)
		return ExitOK
	case "create", "rotate-key", "revoke", "ls":
	default:
		return usageErr(stderr, "tenant", fmt.Errorf("unknown subcommand %q\n\n%s", sub, strings.TrimSuffix(tenantUsage, "\n")))
	}
	fs := newFlags("tenant "+sub, stderr)
	var c common
	c.register(fs)
	dsn := fs.String("store", "", "write to this store directly (a postgres:// DSN or a SQLite path) instead of calling the admin API")
	reason := fs.String("reason", "", "why, for the audit log")
	var scopes scopeList
	fs.Var(&scopes, "scope", "an operator scope of the new key: admin or read-only (repeatable)")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "tenant "+sub, err)
	}
	want := 1
	if sub == "ls" {
		want = len(pos) // 0 or 1
	}
	if len(pos) != want || len(pos) > 1 {
		what := "give one TENANT"
		switch sub {
		case "revoke":
			what = "give one KEY_ID"
		case "ls":
			what = "give at most one TENANT"
		}
		return usageErr(stderr, "tenant "+sub, errors.New(what))
	}
	arg := ""
	if len(pos) == 1 {
		arg = pos[0]
	}
	if (sub == "create" || sub == "rotate-key") && !md.ValidTenant(arg) {
		return usageErr(stderr, "tenant "+sub, fmt.Errorf("tenant %q: use letters, digits, '.', '_' and '-', at most 64", arg))
	}
	if len(scopes) > 0 && sub != "create" && sub != "rotate-key" {
		return usageErr(stderr, "tenant "+sub, errors.New("--scope is for create and rotate-key"))
	}
	asJSON := &c.json
	if *dsn == "" {
		return tenantViaAPI(ctx, &c, sub, arg, scopes, *reason, stdout, stderr)
	}
	ctx, cancel := context.WithTimeout(ctx, tenantTimeout)
	defer cancel()
	st, err := store.Open(ctx, *dsn)
	if err != nil {
		fmt.Fprintln(stderr, "curfew tenant: --store:", err)
		return ExitFail
	}
	defer func() { _ = st.Close() }()
	switch sub {
	case "create", "rotate-key":
		return tenantNewKey(ctx, st, arg, scopes, sub == "rotate-key", *asJSON, stdout, stderr)
	case "revoke":
		k, err := st.RevokeAPIKey(ctx, arg)
		if err != nil {
			fmt.Fprintf(stderr, "curfew tenant revoke: %s: %v\n", arg, err)
			return ExitFail
		}
		return printRevoked(stdout, k, *asJSON)
	default: // ls
		keys, err := st.ListAPIKeys(ctx, arg)
		if err != nil {
			fmt.Fprintln(stderr, "curfew tenant ls:", err)
			return ExitFail
		}
		return printKeys(stdout, keys, *asJSON)
	}
}

func printKeys(stdout io.Writer, keys []store.APIKey, asJSON bool) int {
	if asJSON {
		out := make([]any, 0, len(keys))
		for _, k := range keys {
			out = append(out, keyJSON(k))
		}
		return writeJSONLine(stdout, map[string]any{"keys": out})
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TENANT\tKEY ID\tCREATED\tSCOPES\tSTATE")
	for _, k := range keys {
		state := "valid"
		if k.Revoked() {
			state = "revoked " + k.RevokedAt.UTC().Format(time.RFC3339)
		}
		sc := strings.Join(k.Scopes, ",")
		if sc == "" {
			sc = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", k.Tenant, k.ID, k.CreatedAt.UTC().Format(time.RFC3339), sc, state)
	}
	_ = tw.Flush()
	return ExitOK
}

// storeDSN is --store, else the SQLite file of `curfew up` in dataDir when it exists.
func storeDSN(dsn, dataDir string) (string, error) {
	if dsn != "" {
		return dsn, nil
	}
	abs, err := filepath.Abs(filepath.Join(dataDir, "curfew.db"))
	if err != nil {
		return "", fmt.Errorf("--data-dir: %w", err)
	}
	if _, err := os.Stat(abs); err != nil {
		return "", fmt.Errorf("no store: %s does not exist (give --store, or run curfew up first)", abs)
	}
	return "sqlite://" + abs, nil
}

func tenantNewKey(ctx context.Context, st store.Store, tenant string, scopes []string, rotate, asJSON bool, stdout, stderr io.Writer) int {
	k, err := apikey.New(tenant)
	if err != nil {
		fmt.Fprintln(stderr, "curfew tenant:", err)
		return ExitFail
	}
	k.Record.Scopes = scopes
	rec, revoked, err := st.CreateAPIKey(ctx, k.Record, rotate)
	if err != nil {
		fmt.Fprintln(stderr, "curfew tenant:", err)
		return ExitFail
	}
	return printNewKey(stdout, rec, k.Secret, revoked, rotate, asJSON)
}

func printNewKey(stdout io.Writer, rec store.APIKey, secret string, revoked int64, rotate, asJSON bool) int {
	tenant := rec.Tenant
	k := struct{ Secret string }{secret}
	if asJSON {
		j := keyJSON(rec)
		j["key"] = k.Secret
		j["revoked_keys"] = revoked
		return writeJSONLine(stdout, j)
	}
	fmt.Fprintf(stdout, "tenant %s: new key %s\n\n  %s\n\nThis is the only time the key is shown; keep it in a secret store.\n", tenant, rec.ID, k.Secret)
	if rotate {
		fmt.Fprintf(stdout, "%d other key(s) of %s revoked.\n", revoked, tenant)
	}
	return ExitOK
}

func keyJSON(k store.APIKey) map[string]any {
	m := map[string]any{"tenant": k.Tenant, "key_id": k.ID, "created_at": k.CreatedAt.UTC().Format(time.RFC3339Nano)}
	if k.Revoked() {
		m["revoked_at"] = k.RevokedAt.UTC().Format(time.RFC3339Nano)
	}
	if len(k.Scopes) > 0 {
		m["scopes"] = k.Scopes
	}
	return m
}

func writeJSONLine(w io.Writer, v any) int {
	b, err := json.Marshal(v)
	if err != nil {
		fmt.Fprintf(w, "{\"error\":%q}\n", err.Error())
		return ExitFail
	}
	fmt.Fprintln(w, string(b))
	return ExitOK
}

func printRevoked(stdout io.Writer, k store.APIKey, asJSON bool) int {
	if asJSON {
		return writeJSONLine(stdout, keyJSON(k))
	}
	fmt.Fprintf(stdout, "key %s of tenant %s revoked at %s\n", k.ID, k.Tenant, k.RevokedAt.UTC().Format(time.RFC3339))
	return ExitOK
}
