package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/curfew-mesh/curfew/internal/launch"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/service"
)

// Exit codes.
const (
	ExitOK    = 0
	ExitFail  = 1 // the run or the call did not succeed
	ExitUsage = 2
)

const usage = `curfew: one absolute deadline and one stop signal for agent trees.

Usage:
  curfew up      [--data-dir DIR] [--base-port N] [--bin-dir DIR] [--store DSN]
                 [--providers-config FILE] [--admission-config FILE] [--tools-config FILE]
                 [--shutdown-grace D] [--start-timeout D] [--max-restarts N] [--insecure] [--json]
  curfew run     (--plan FILE | TASK) [--deadline D] [--model M] [--continue] [--cancel-after D] [--events all|nodes|summary] [--json]
  curfew get     RUN [--json]
  curfew ls      [--limit N] [--model M] [--since D|TIME] [--until D|TIME] [--json]
  curfew cancel  RUN [--reason TEXT] [--json]
  curfew trace   RUN [--width N] [--json]
  curfew dlq     ls [--run RUN] [--all] [--limit N] [--json]
  curfew dlq     show ID [--json]
  curfew dlq     replay ID [--timeout D] [--json]
  curfew dlq     purge (--id ID | --before TIME | --replayed) [--json]
  curfew drill   [--mode shed|orphan] [--fault N] [--tasks N] [--deadline D] [--cancel-at D]
                 [--tps N] [--heartbeat D] [--lease-ttl D] [--slow-heartbeat D] [--bin-dir DIR] [--json]
  curfew tenant  (create TENANT | rotate-key TENANT | revoke KEY_ID | ls [TENANT]) [--scope S] [--reason R] [--json]
  curfew status  [--json]
  curfew pool    (close POOL | open POOL [--force] | reopen POOL --when-orphan-delta-zero FOR [--wait D]) [--reason R] [--json]
  curfew audit   ls [--since D|TIME] [--limit N] [--json]
  curfew usage   [--tenant T] [--since D|TIME] [--json]
  curfew leases  ls [--older-than D] [--json]
  curfew leases  cancel --older-than D [--reason R] [--json]
  curfew ledger  (freeze | thaw) (--run ID [--tenant T] | --tenant T) [--reason R] [--json]
  curfew ledger  ls [--json]
  curfew decoders drain [--pool P] [--cancel-after D] [--reason R] [--json]
  curfew decoders undrain [--pool P] [--reason R] [--json]
  curfew outbox  ls [TENANT] [--channel C] [--pending] [--after ID] [--limit N] [--store DSN] [--json]
  curfew approve|deny RUN NODE [--tenant T] [--reason R] [--json]
  curfew approvals ls [--all] [--tenant T] [--run ID] [--json]
  curfew tls     (init DIR [--host NAME]... | k8s-secrets DIR [--namespace NS])
  curfew version

Every command except up takes --addr (default: the orchestrator in DIR/endpoints.json,
else 127.0.0.1:7700) and --data-dir (default $CURFEW_DATA_DIR, else ~/.curfew). They
connect with mTLS as curfew-cli (DIR/tls) when the mesh runs it, and in plaintext with
--insecure. They send $CURFEW_API_KEY, a tenant's API key, when it is set: the calls then
act for that tenant.

Every command takes --log-level (debug, info, warn or error; default warn): the least
level of the library logs, such as a certificate loaded, it writes on stderr.
`

// Main runs the command line and returns the exit code.
func Main(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return ExitUsage
	}
	cmds := map[string]func(context.Context, []string, io.Writer, io.Writer) int{
		"up": cmdUp, "run": cmdRun, "get": cmdGet, "ls": cmdLs, "cancel": cmdCancel, "trace": cmdTrace,
		"dlq": cmdDlq, "drill": cmdDrill, "tenant": cmdTenant, "tls": cmdTLS, "audit": cmdAudit, "usage": cmdUsage, "outbox": cmdOutbox,
		"pool": cmdPool, "status": cmdStatus,
		"leases": cmdLeases, "ledger": cmdLedger, "decoders": cmdDecoders,
		"approve": cmdApprove(true), "deny": cmdApprove(false), "approvals": cmdApprovals,
	}
	switch args[0] {
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return ExitOK
	case "version", "--version":
		fmt.Fprintln(stdout, "curfew", service.BuildVersion())
		return ExitOK
	}
	cmd, ok := cmds[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "curfew: unknown command %q\n\n%s", args[0], usage)
		return ExitUsage
	}
	return cmd(ctx, args[1:], stdout, stderr)
}

// common flags of the client commands.
type common struct {
	addr     string
	dataDir  string
	json     bool
	insecure bool
	fs       *flags // the command's flags, for its logger; nil: slog.Default
}

func (c *common) register(fs *flags) {
	c.fs = fs
	fs.StringVar(&c.addr, "addr", os.Getenv("CURFEW_ADDR"), "orchestrator address (default: from endpoints.json, else 127.0.0.1:7700)")
	fs.StringVar(&c.dataDir, "data-dir", defaultDataDir(), "data directory of `curfew up`")
	fs.BoolVar(&c.json, "json", false, "print JSON for scripts")
	fs.BoolVar(&c.insecure, "insecure", false, "connect in plaintext, to a mesh started with `curfew up --insecure` (default: mTLS with DIR/tls when the mesh runs it)")
}

func defaultDataDir() string {
	if d := os.Getenv("CURFEW_DATA_DIR"); d != "" {
		return d
	}
	if h, err := os.UserHomeDir(); err == nil {
		return filepath.Join(h, ".curfew")
	}
	return ".curfew"
}

// orchestratorAddr resolves the orchestrator's address.
func (c *common) orchestratorAddr() string {
	if c.addr != "" {
		return c.addr
	}
	if eps, err := readEndpoints(c.dataDir); err == nil {
		if e, ok := eps.Services["orchestrator"]; ok {
			return e.Addr
		}
	}
	return "127.0.0.1:7700"
}

// dial connects to the orchestrator: as the mesh peer curfew-cli over mTLS when the mesh
// runs it, and with an API key (apiKey) when there is one, which then names the tenant.
func (c *common) dial() (*grpc.ClientConn, error) {
	dir := c.tlsDir()
	creds, err := launch.ClientCredentials(dir, meshtls.Orchestrator, c.logger())
	if err != nil {
		return nil, err
	}
	key, err := c.apiKey(dir == "")
	if err != nil {
		return nil, err
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds), withTracing()}
	if key != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(apikey.Bearer(key)))
	}
	return grpc.NewClient(c.orchestratorAddr(), opts...)
}

// logger is the command's logger of library logs.
func (c *common) logger() *slog.Logger {
	if c.fs == nil {
		return nil
	}
	return c.fs.logger()
}

// parse parses interspersed flags and positional arguments.
func parse(fs *flags, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

var pj = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: false}

func printJSON(w io.Writer, m proto.Message) {
	b, err := pj.Marshal(m)
	if err != nil {
		fmt.Fprintf(w, "{\"error\":%q}\n", err.Error())
		return
	}
	// protojson output is deliberately unstable in whitespace; normalize it to one line.
	var v any
	if json.Unmarshal(b, &v) == nil {
		b, _ = json.Marshal(v)
	}
	fmt.Fprintln(w, string(b))
}

// callErr prints a failed call's status and returns the exit code.
func callErr(stderr io.Writer, what string, err error) int {
	if s, ok := status.FromError(err); ok {
		fmt.Fprintf(stderr, "curfew: %s: %s: %s\n", what, s.Code(), s.Message())
	} else {
		fmt.Fprintf(stderr, "curfew: %s: %v\n", what, err)
	}
	return ExitFail
}

func usageErr(stderr io.Writer, cmd string, err error) int {
	if errors.Is(err, flag.ErrHelp) {
		return ExitUsage
	}
	fmt.Fprintf(stderr, "curfew %s: %v\n", cmd, err)
	return ExitUsage
}

// flags is a command's flag set, with the --log-level every command takes.
type flags struct {
	*flag.FlagSet
	level  logLevel
	stderr io.Writer
}

func newFlags(name string, stderr io.Writer) *flags {
	fs := flag.NewFlagSet("curfew "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	f := &flags{FlagSet: fs, level: logLevel(slog.LevelWarn), stderr: stderr}
	fs.Var(&f.level, "log-level", "the least `level` of the library logs written on stderr: debug, info, warn or error")
	return f
}

// logger is the command's logger of library logs (a certificate loaded, say): on
// stderr, at --log-level. The command's own output does not go through it.
func (f *flags) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(f.stderr, &slog.HandlerOptions{Level: slog.Level(f.level)}))
}

// logLevel is the value of --log-level.
type logLevel slog.Level

func (l *logLevel) String() string { return strings.ToLower(slog.Level(*l).String()) }

func (l *logLevel) Set(s string) error {
	lv, ok := map[string]slog.Level{"debug": slog.LevelDebug, "info": slog.LevelInfo, "warn": slog.LevelWarn, "error": slog.LevelError}[strings.ToLower(s)]
	if !ok {
		return errors.New("want debug, info, warn or error")
	}
	*l = logLevel(lv)
	return nil
}

func lower(s, prefix string) string {
	return strings.ToLower(strings.TrimPrefix(s, prefix))
}
