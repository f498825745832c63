package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/curfew-mesh/curfew/mesh/outbox"
	"github.com/curfew-mesh/curfew/mesh/store"
)

const outboxUsage = `Usage:
  curfew outbox ls [TENANT] [--channel C] [--pending] [--after ID] [--limit N] [--store DSN] [--data-dir DIR] [--json]

The outbox: every notify, by ascending id, with its relay state (relayed to NATS
JetStream, or pending), tenant, channel, position on the channel and key (its
Nats-Msg-Id on the stream). Of one tenant, or all. docs/outbox.md explains the relay.
It reads the store directly (--store, default $CURFEW_STORE, else curfew.db in the data
directory), so it needs the store's credentials, not a running mesh.
`

func cmdOutbox(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		return usageErr(stderr, "outbox", errors.New("give a subcommand: ls\n\n"+strings.TrimSuffix(outboxUsage, "\n")))
	}
	sub, args := args[0], args[1:]
	switch sub {
	case "help", "-h", "--help":
		fmt.Fprint(stdout, outboxUsage)
		return ExitOK
	case "ls":
	default:
		return usageErr(stderr, "outbox", fmt.Errorf("unknown subcommand %q\n\n%s", sub, strings.TrimSuffix(outboxUsage, "\n")))
	}
	fs := newFlags("outbox ls", stderr)
	dsn := fs.String("store", os.Getenv("CURFEW_STORE"), "the store: a postgres:// DSN or a SQLite path (default: curfew.db in --data-dir)")
	dataDir := fs.String("data-dir", defaultDataDir(), "data directory of `curfew up`")
	channel := fs.String("channel", "", "only this channel")
	pending := fs.Bool("pending", false, "only rows not yet relayed")
	after := fs.Int64("after", 0, "only rows with a greater id (the last id of the previous page)")
	limit := fs.Int("limit", 100, "at most this many rows (1 to 1000)")
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "outbox ls", err)
	}
	if len(pos) > 1 {
		return usageErr(stderr, "outbox ls", errors.New("give at most one TENANT"))
	}
	if *limit < 1 || *limit > 1000 {
		return usageErr(stderr, "outbox ls", errors.New("--limit must be between 1 and 1000"))
	}
	q := store.OutboxQuery{Channel: *channel, OnlyPending: *pending, After: *after, Limit: *limit}
	if len(pos) == 1 {
		q.Tenant = pos[0]
	}
	if *dsn, err = storeDSN(*dsn, *dataDir); err != nil {
		return usageErr(stderr, "outbox ls", err)
	}
	ctx, cancel := context.WithTimeout(ctx, tenantTimeout)
	defer cancel()
	st, err := store.Open(ctx, *dsn)
	if err != nil {
		fmt.Fprintln(stderr, "curfew outbox: --store:", err)
		return ExitFail
	}
	defer func() { _ = st.Close() }()
	rows, err := outbox.List(ctx, st, q)
	if err != nil {
		fmt.Fprintln(stderr, "curfew outbox ls:", err)
		return ExitFail
	}
	if *asJSON {
		return writeJSONLine(stdout, map[string]any{"rows": rows})
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tTENANT\tCHANNEL\tPOS\tKEY\tCREATED")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\n", r.ID, r.State, r.Tenant, r.Channel, r.ChannelSeq, r.Key, r.CreatedAt.UTC().Format(time.RFC3339))
	}
	_ = tw.Flush()
	return ExitOK
}
