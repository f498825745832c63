package registry

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// The kinds of source.
const (
	KindMCPStdio = "mcp_stdio" // an MCP server toolrunner starts as a child process
	KindMCPHTTP  = "mcp_http"  // an MCP server over streamable HTTP
	KindGRPC     = "grpc"      // a curfew.tool.v1.ToolService server
)

// BuiltinSource is the name the built-in tools are listed under; no source may take it.
const BuiltinSource = "builtin"

// Defaults of the policy's unset fields.
const (
	// DefaultMinTime is the least time left before the deadline to start a call.
	DefaultMinTime = 10 * time.Millisecond
	// DefaultConcurrency is the most calls in flight to one source.
	DefaultConcurrency = 32
	// DefaultMaxOutputBytes caps a tool's result (1 MiB).
	DefaultMaxOutputBytes = 1 << 20
	// MaxSourceNameLen is the longest source name.
	MaxSourceNameLen = 32
)

// sourceName is the rule of a source's name: no underscore, so that the first "__" of a
// tool's name always ends its source's.
var sourceName = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9-]{0,31}$`)

// Config is a tools configuration file.
type Config struct {
	Sources []SourceConfig
}

// SourceConfig is one source of the file.
type SourceConfig struct {
	// Name namespaces the source's tools (Name(source, tool)): 1 to 32 letters, digits
	// and hyphens, starting with a letter or digit.
	Name string
	// Kind is KindMCPStdio, KindMCPHTTP or KindGRPC.
	Kind string
	// Command, Args and Dir start an mcp_stdio server; Env names its environment
	// variables (see Environ).
	Command string
	Args    []string
	Dir     string
	Env     map[string]string // variable → the toolrunner environment variable it is read from
	// URL reaches an mcp_http server; Headers are sent with every request (see Header).
	URL     string
	Headers map[string]string // header → the environment variable it is read from
	// Address reaches a grpc server (host:port, or a gRPC target such as dns:///name:port).
	Address string
	// TLS, when set, makes a grpc source's connection TLS; nil is plaintext (h2c).
	TLS *TLSConfig
	// Trusted says the source's own hints about its tools' effects are believed.
	Trusted bool
	// Policy is the source's policy; Tools overrides it per tool (by the tool's name on
	// the source), field by field.
	Policy Policy
	Tools  map[string]Policy
}

// Policy is what governs calls of a tool. nil and empty fields are unset: a tool's
// override inherits the source's, the source's takes the default.
type Policy struct {
	// SideEffects, when set, decides the tool's effects whatever the source says.
	SideEffects *catalog.SideEffects
	// MinTime is the least time left to start a call (DefaultMinTime).
	MinTime *time.Duration
	// Concurrency bounds calls in flight: on the source, the source's calls in all
	// (DefaultConcurrency); on a tool, that tool's calls too (no bound of its own unset).
	Concurrency *int
	// Retry shapes toolrunner's retries of the tool (retry.Policy's defaults).
	Retry *retry.PolicyJSON
	// MaxOutputBytes caps the result (DefaultMaxOutputBytes).
	MaxOutputBytes *int
	// Tenants, when set, are the only tenants that may see and call the tool.
	Tenants []string
	// Approval, when set, says whether a call waits for a human's approval before its
	// effect (docs/operations.md, "Approval gates"), whatever the source's hints say.
	// Unset: only when the source says destructiveHint true explicitly.
	Approval *bool
}

// Environ returns an mcp_stdio server's environment: PATH and HOME from toolrunner's,
// and the variables Env names, read now. Nothing else of toolrunner's environment (its
// store DSN, its keys) reaches the child.
func (s SourceConfig) Environ() []string {
	var out []string
	for _, k := range []string{"PATH", "HOME"} {
		if v, ok := os.LookupEnv(k); ok {
			if _, mine := s.Env[k]; !mine {
				out = append(out, k+"="+v)
			}
		}
	}
	for _, k := range sortedKeys(s.Env) {
		out = append(out, k+"="+os.Getenv(s.Env[k]))
	}
	return out
}

// Header returns an mcp_http server's headers, read now from the variables Headers names.
func (s SourceConfig) Header() http.Header {
	h := http.Header{}
	for _, k := range sortedKeys(s.Headers) {
		h.Set(k, os.Getenv(s.Headers[k]))
	}
	return h
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// The file's JSON shapes, decoded level by level so that errors name their path.
type fileJSON struct {
	Sources []json.RawMessage `json:"sources"`
}

type sourceJSON struct {
	Name    string                     `json:"name"`
	Kind    string                     `json:"kind"`
	Command string                     `json:"command"`
	Args    []string                   `json:"args"`
	Env     map[string]json.RawMessage `json:"env"`
	Dir     string                     `json:"dir"`
	URL     string                     `json:"url"`
	Headers map[string]json.RawMessage `json:"headers"`
	Address string                     `json:"address"`
	TLS     json.RawMessage            `json:"tls"`
	Trusted bool                       `json:"trusted"`
	policyJSON
	Tools map[string]json.RawMessage `json:"tools"`
}

type policyJSON struct {
	SideEffects    string          `json:"side_effects"`
	MinTime        string          `json:"min_time"`
	Concurrency    *int            `json:"concurrency"`
	Retry          json.RawMessage `json:"retry"`
	MaxOutputBytes *int            `json:"max_output_bytes"`
	Tenants        []string        `json:"tenants"`
	Approval       *bool           `json:"approval"`
}

type secretJSON struct {
	FromEnv string `json:"from_env"`
}

// Load reads, checks and returns the tools configuration file at path. Errors name the
// file, the field's path (sources[0].headers.Authorization) and the rule it breaks.
func Load(path string) (*Config, error) {
	b, err := os.ReadFile(path) //nolint:gosec // the operator names the file (--tools-config)
	if err != nil {
		return nil, err
	}
	c, err := Parse(b, os.LookupEnv, exec.LookPath)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Parse checks and returns a configuration: lookupEnv resolves the variables it names,
// lookPath an mcp_stdio command.
func Parse(b []byte, lookupEnv func(string) (string, bool), lookPath func(string) (string, error)) (*Config, error) {
	var f fileJSON
	if err := strict(b, &f, ""); err != nil {
		return nil, err
	}
	c := &Config{}
	names := map[string]int{}
	for i, raw := range f.Sources {
		path := fmt.Sprintf("sources[%d]", i)
		s, err := parseSource(raw, path, lookupEnv, lookPath)
		if err != nil {
			return nil, err
		}
		if j, dup := names[s.Name]; dup {
			return nil, fmt.Errorf("%s.name: duplicate source name %q (also sources[%d])", path, s.Name, j)
		}
		names[s.Name] = i
		c.Sources = append(c.Sources, s)
	}
	return c, nil
}

func parseSource(raw []byte, path string, lookupEnv func(string) (string, bool), lookPath func(string) (string, error)) (SourceConfig, error) {
	var j sourceJSON
	if err := strict(raw, &j, path); err != nil {
		return SourceConfig{}, err
	}
	s := SourceConfig{Name: j.Name, Kind: j.Kind, Command: j.Command, Args: j.Args, Dir: j.Dir, URL: j.URL,
		Address: j.Address, Trusted: j.Trusted}
	switch {
	case j.Name == BuiltinSource:
		return s, fmt.Errorf("%s.name: %q is the built-in tools' name", path, j.Name)
	case !sourceName.MatchString(j.Name):
		return s, fmt.Errorf("%s.name: %q must be 1 to %d letters, digits and hyphens, starting with a letter or digit (no underscores: \"__\" separates source and tool)",
			path, j.Name, MaxSourceNameLen)
	}
	// Fields of another kind are refused: they would be silently ignored.
	unused := func(field string, set bool) error {
		if set {
			return fmt.Errorf("%s.%s: not used by kind %q", path, field, j.Kind)
		}
		return nil
	}
	var err error
	switch j.Kind {
	case KindMCPStdio:
		err = errors.Join(unused("url", j.URL != ""), unused("headers", j.Headers != nil), unused("address", j.Address != ""),
			unused("tls", j.TLS != nil))
		if err == nil {
			err = checkCommand(j.Command, path, lookPath)
		}
		if err == nil && j.Dir != "" {
			if fi, serr := os.Stat(j.Dir); serr != nil || !fi.IsDir() {
				err = fmt.Errorf("%s.dir: %q is not a directory", path, j.Dir)
			}
		}
	case KindMCPHTTP:
		err = errors.Join(unused("command", j.Command != ""), unused("args", j.Args != nil), unused("env", j.Env != nil),
			unused("dir", j.Dir != ""), unused("address", j.Address != ""), unused("tls", j.TLS != nil))
		if err == nil {
			err = checkURL(j.URL, path)
		}
	case KindGRPC:
		err = errors.Join(unused("command", j.Command != ""), unused("args", j.Args != nil), unused("env", j.Env != nil),
			unused("dir", j.Dir != ""), unused("url", j.URL != ""), unused("headers", j.Headers != nil))
		if err == nil && strings.TrimSpace(j.Address) == "" {
			err = fmt.Errorf("%s.address: is required for kind %q", path, j.Kind)
		}
		if err == nil && j.TLS != nil && string(bytes.TrimSpace(j.TLS)) != "null" {
			s.TLS, err = parseTLS(j.TLS, path+".tls")
		}
	case "":
		return s, fmt.Errorf("%s.kind: is required (%s, %s or %s)", path, KindMCPStdio, KindMCPHTTP, KindGRPC)
	default:
		return s, fmt.Errorf("%s.kind: unknown kind %q (%s, %s or %s)", path, j.Kind, KindMCPStdio, KindMCPHTTP, KindGRPC)
	}
	if err != nil {
		return s, err
	}
	if s.Env, err = secrets(j.Env, path+".env", lookupEnv); err != nil {
		return s, err
	}
	if s.Headers, err = secrets(j.Headers, path+".headers", lookupEnv); err != nil {
		return s, err
	}
	if s.Policy, err = parsePolicy(j.policyJSON, path); err != nil {
		return s, err
	}
	if s.Policy.Concurrency != nil && *s.Policy.Concurrency < 1 {
		return s, fmt.Errorf("%s.concurrency: must be at least 1, got %d", path, *s.Policy.Concurrency)
	}
	s.Tools = map[string]Policy{}
	for _, name := range sortedKeys(j.Tools) {
		tp := fmt.Sprintf("%s.tools[%q]", path, name)
		if name == "" {
			return s, fmt.Errorf("%s: a tool's name must not be empty", tp)
		}
		var pj policyJSON
		if err := strict(j.Tools[name], &pj, tp); err != nil {
			return s, err
		}
		p, err := parsePolicy(pj, tp)
		if err != nil {
			return s, err
		}
		if p.Concurrency != nil && *p.Concurrency < 1 {
			return s, fmt.Errorf("%s.concurrency: must be at least 1, got %d", tp, *p.Concurrency)
		}
		s.Tools[name] = p
	}
	return s, nil
}

func checkCommand(command, path string, lookPath func(string) (string, error)) error {
	if strings.TrimSpace(command) == "" {
		return fmt.Errorf("%s.command: is required for kind %q", path, KindMCPStdio)
	}
	if _, err := lookPath(command); err != nil {
		return fmt.Errorf("%s.command: %q is not an executable on PATH or at that path: %w", path, command, err)
	}
	return nil
}

func checkURL(raw, path string) error {
	if raw == "" {
		return fmt.Errorf("%s.url: is required for kind %q", path, KindMCPHTTP)
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return fmt.Errorf("%s.url: %w", path, err)
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("%s.url: %q must be an http:// or https:// URL", path, raw)
	case u.Host == "":
		return fmt.Errorf("%s.url: %q has no host", path, raw)
	case u.User != nil:
		return fmt.Errorf("%s.url: credentials in the URL are not allowed: send them in headers, from the environment", path)
	}
	return nil
}

// secrets resolves {"NAME": {"from_env": "VAR"}}: a value written inline is refused, and
// so is a variable that is not set.
func secrets(m map[string]json.RawMessage, path string, lookupEnv func(string) (string, bool)) (map[string]string, error) {
	if m == nil {
		return nil, nil
	}
	out := map[string]string{}
	for _, k := range sortedKeys(m) {
		p := fmt.Sprintf("%s[%q]", path, k)
		if k == "" {
			return nil, fmt.Errorf("%s: the name must not be empty", p)
		}
		raw := bytes.TrimSpace(m[k])
		if len(raw) > 0 && raw[0] != '{' {
			return nil, fmt.Errorf(`%s: inline values are not allowed (secrets stay out of the file): write {"from_env": "VARIABLE"} and set that variable in toolrunner's environment`, p)
		}
		var s secretJSON
		if err := strict(raw, &s, p); err != nil {
			return nil, err
		}
		if s.FromEnv == "" {
			return nil, fmt.Errorf("%s.from_env: is required", p)
		}
		if _, ok := lookupEnv(s.FromEnv); !ok {
			return nil, fmt.Errorf("%s.from_env: environment variable %s is not set", p, s.FromEnv)
		}
		out[k] = s.FromEnv
	}
	return out, nil
}

func parsePolicy(j policyJSON, path string) (Policy, error) {
	p := Policy{Concurrency: j.Concurrency, MaxOutputBytes: j.MaxOutputBytes, Tenants: j.Tenants, Approval: j.Approval}
	if j.SideEffects != "" {
		e, ok := map[string]catalog.SideEffects{"none": catalog.None, "idempotent": catalog.Idempotent, "irreversible": catalog.Irreversible}[j.SideEffects]
		if !ok {
			return p, fmt.Errorf("%s.side_effects: %q must be none, idempotent or irreversible", path, j.SideEffects)
		}
		p.SideEffects = &e
	}
	if j.MinTime != "" {
		d, err := time.ParseDuration(j.MinTime)
		if err != nil || d < 0 {
			return p, fmt.Errorf("%s.min_time: %q is not a duration such as \"200ms\" (at least 0)", path, j.MinTime)
		}
		p.MinTime = &d
	}
	if p.MaxOutputBytes != nil && *p.MaxOutputBytes < 1 {
		return p, fmt.Errorf("%s.max_output_bytes: must be at least 1, got %d", path, *p.MaxOutputBytes)
	}
	if j.Tenants != nil && len(j.Tenants) == 0 {
		return p, fmt.Errorf("%s.tenants: an empty list would hide the tool from every tenant: leave it out to allow all", path)
	}
	for i, t := range j.Tenants {
		if t == "" {
			return p, fmt.Errorf("%s.tenants[%d]: must not be empty", path, i)
		}
	}
	if len(j.Retry) > 0 {
		var r retry.PolicyJSON
		if err := strict(j.Retry, &r, path+".retry"); err != nil {
			return p, err
		}
		if r.NonIdempotent != nil {
			return p, fmt.Errorf("%s.retry.non_idempotent: set side_effects instead", path)
		}
		if err := r.Apply(retry.Policy{}).Validate(); err != nil {
			return p, fmt.Errorf("%s.retry: %w", path, err)
		}
		p.Retry = &r
	}
	return p, nil
}

// strict decodes data into v, refusing unknown fields and trailing data; errors name path.
func strict(data []byte, v any, path string) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	at := func(field string) string {
		switch {
		case path == "" && field == "":
			return "the file"
		case path == "":
			return field
		case field == "":
			return path
		}
		return path + "." + field
	}
	if err := dec.Decode(v); err != nil {
		var te *json.UnmarshalTypeError
		var se *json.SyntaxError
		switch {
		case errors.As(err, &te):
			// (The embedded policy's fields are the source's own.)
			return fmt.Errorf("%s: must be %s, got %s", at(strings.ReplaceAll(te.Field, "policyJSON.", "")), te.Type, te.Value)
		case errors.As(err, &se):
			return fmt.Errorf("%s: invalid JSON at offset %d: %w", at(""), se.Offset, err)
		case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
			return fmt.Errorf("%s: invalid JSON: it ends before the object is complete", at(""))
		case strings.HasPrefix(err.Error(), "json: unknown field "):
			return fmt.Errorf("%s: unknown field %s", at(""), strings.TrimPrefix(err.Error(), "json: unknown field "))
		}
		return fmt.Errorf("%s: %w", at(""), err)
	}
	if dec.More() {
		return fmt.Errorf("%s: trailing data after the JSON value", at(""))
	}
	return nil
}
