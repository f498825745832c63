package cli

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/curfew-mesh/curfew/internal/launch"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

const tlsUsage = `curfew tls: the mesh's certificates, outside curfew up (for Kubernetes, say).

  curfew tls init DIR [--host NAME]... [--valid-for D]
      creates the mesh CA in DIR (kept when DIR already holds one) and issues a
      certificate to each service and to curfew-cli; running it again re-issues them (a
      rotation: services that read DIR pick the new files up without a restart). The
      orchestrator's certificate also names each --host, for callers from outside the
      mesh that check a host name (default: the curfew-api Service's names in
      namespace curfew). DIR/ca.key, the CA's key, stays in DIR: keep it off the cluster.
  curfew tls k8s-secrets DIR [--namespace NS]
      prints a Secret curfew-tls-<service> per service (ca.crt, <service>.crt,
      <service>.key), as the manifests in k8s/ mount them, for kubectl apply -f -. The CA
      key is never in them.
`

// defaultAPIHosts are the names of the curfew-api Service in namespace curfew.
var defaultAPIHosts = []string{"curfew-api", "curfew-api.curfew", "curfew-api.curfew.svc", "curfew-api.curfew.svc.cluster.local"}

// meshServices are the identities that run as services (launch.Identities less the CLI).
var meshServices = []string{meshtls.Orchestrator, meshtls.ToolRunner, meshtls.Subagent, meshtls.ModelProxy}

type hostList []string

func (h *hostList) String() string { return strings.Join(*h, ",") }

func (h *hostList) Set(v string) error {
	if v == "" || strings.ContainsAny(v, " \t/,") {
		return fmt.Errorf("%q is not a host name or IP address", v)
	}
	*h = append(*h, v)
	return nil
}

var dnsLabel = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)

func cmdTLS(_ context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		return usageErr(stderr, "tls", errors.New("give a subcommand: init or k8s-secrets\n\n"+strings.TrimSuffix(tlsUsage, "\n")))
	}
	sub, args := args[0], args[1:]
	fs := newFlags("tls "+sub, stderr)
	var hosts hostList
	validFor, namespace := new(time.Duration), new(string)
	switch sub {
	case "help", "-h", "--help":
		fmt.Fprint(stdout, tlsUsage)
		return ExitOK
	case "init":
		fs.Var(&hosts, "host", "a DNS name or IP the orchestrator's certificate names besides localhost (repeatable; default: the curfew-api Service's names)")
		fs.DurationVar(validFor, "valid-for", meshtls.DefaultCertValidity, "validity of each certificate issued (never beyond the CA's)")
	case "k8s-secrets":
		fs.StringVar(namespace, "namespace", "curfew", "namespace of the Secrets")
	default:
		return usageErr(stderr, "tls", fmt.Errorf("unknown subcommand %q\n\n%s", sub, strings.TrimSuffix(tlsUsage, "\n")))
	}
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "tls "+sub, err)
	}
	if len(pos) != 1 {
		return usageErr(stderr, "tls "+sub, errors.New("give one DIR"))
	}
	dir := pos[0]
	if sub == "init" {
		if *validFor <= 0 {
			return usageErr(stderr, "tls init", errors.New("--valid-for must be positive"))
		}
		if len(hosts) == 0 {
			hosts = defaultAPIHosts
		}
		if err := launch.IssueCerts(dir, hosts, *validFor); err != nil {
			fmt.Fprintln(stderr, "curfew tls init:", err)
			return ExitFail
		}
		fmt.Fprintf(stdout, "mesh CA and certificates for %s in %s\n", strings.Join(launch.Identities, ", "), dir)
		return ExitOK
	}
	if !dnsLabel.MatchString(*namespace) { // also keeps the YAML below well formed
		return usageErr(stderr, "tls k8s-secrets", fmt.Errorf("--namespace %q is not a namespace name", *namespace))
	}
	if err := k8sSecrets(stdout, dir, *namespace); err != nil {
		fmt.Fprintln(stderr, "curfew tls k8s-secrets:", err)
		return ExitFail
	}
	return ExitOK
}

// k8sSecrets writes the Secret of each service's files in dir as YAML documents.
func k8sSecrets(w io.Writer, dir, namespace string) error {
	for i, svc := range meshServices {
		files := []string{meshtls.CACertFile, svc + ".crt", svc + ".key"}
		data := make([]string, len(files))
		for j, f := range files {
			b, err := os.ReadFile(filepath.Join(dir, f)) //nolint:gosec // a certificate file in the directory the user names
			if err != nil {
				return fmt.Errorf("%w (run curfew tls init %s first)", err, dir)
			}
			data[j] = base64.StdEncoding.EncodeToString(b)
		}
		if i > 0 {
			fmt.Fprintln(w, "---")
		}
		fmt.Fprintf(w, `# the mesh certificate of %[1]s, mounted as its --tls-dir; made by curfew tls k8s-secrets
apiVersion: v1
kind: Secret
metadata:
  name: curfew-tls-%[1]s
  namespace: %[2]s
  labels:
    app.kubernetes.io/name: %[1]s
    app.kubernetes.io/part-of: curfew
type: Opaque
data:
`, svc, namespace)
		for j, f := range files {
			fmt.Fprintf(w, "  %s: %s\n", f, data[j])
		}
	}
	return nil
}
