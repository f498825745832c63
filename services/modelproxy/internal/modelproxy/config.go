package modelproxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// Defaults of the providers file's optional fields.
const (
	DefaultCacheTTL        = 10 * time.Minute
	DefaultCacheMaxEntries = 1024
	// DefaultShedQuantile is the quantile of observed latencies the proxy sheds by.
	DefaultShedQuantile = 0.9
)

// File is the providers file (--providers-config): the OpenAI-compatible providers, the
// model aliases with their fallback chains, the provider breakers and the response cache.
//
//	{"providers": [{"name": "local", "base_url": "http://127.0.0.1:11434/v1",
//	                "api_key_env": "LOCAL_API_KEY", "timeout": "30s", "models": ["tiny"]}],
//	 "models": {"tiny": {"chain": ["local/tiny", "backup/tiny"], "degrade_to": "backup/small"}},
//	 "breaker": {"failures": 5, "ratio": 0.5, "min_requests": 20, "window": "10s", "open_timeout": "5s"},
//	 "cache": {"ttl": "10m", "max_entries": 1024}}
type File struct {
	Providers []ProviderConfig       `json:"providers"`
	Models    map[string]AliasConfig `json:"models"`
	Breaker   *BreakerConfig         `json:"breaker,omitempty"`
	Cache     *CacheConfig           `json:"cache,omitempty"`
	Shed      *ShedConfig            `json:"shed,omitempty"`
}

// ProviderConfig is one OpenAI-compatible provider.
type ProviderConfig struct {
	// Name is how aliases and nodes name the provider: lowercase letters, digits, '-' and '_'.
	Name string `json:"name"`
	// BaseURL is the provider's API root, the one ending in /v1.
	BaseURL string `json:"base_url"`
	// APIKeyEnv names the environment variable holding the API key; APIKeyFile a file
	// holding it (trailing whitespace trimmed). At most one; neither means no key (a local
	// server). The key itself never appears in the file.
	APIKeyEnv  string `json:"api_key_env,omitempty"`
	APIKeyFile string `json:"api_key_file,omitempty"`
	// Timeout bounds the wait for response headers and the first chunk; the provider
	// package's default when empty.
	Timeout Duration `json:"timeout,omitempty"`
	// Models are the provider's model names that chains may use.
	Models []string `json:"models"`
	// TTFT and TokensPerSecond are declared estimates the proxy sheds by until it has
	// observed the provider (see ShedConfig); zero means no estimate.
	TTFT            Duration `json:"expected_ttft,omitempty"`
	TokensPerSecond float64  `json:"expected_tokens_per_second,omitempty"`
}

// AliasConfig is a model alias: the providers to try, in order, and the degrade policy.
type AliasConfig struct {
	// Chain lists "provider/model" targets. A call goes to the first whose breaker lets
	// it through, and falls back to the next on UNAVAILABLE, 429, 5xx, a timeout or an
	// open breaker; never on a client error or a caller's cancel.
	Chain []string `json:"chain"`
	// DegradeTo, "provider/model", answers a schema-bound call whose answer from the chain
	// failed validation against its response schema. A separate, explicit policy: nothing
	// else ever degrades.
	DegradeTo string `json:"degrade_to,omitempty"`
	// Cacheable makes every call of the alias cacheable, deterministic or not.
	Cacheable bool `json:"cacheable,omitempty"`
}

// BreakerConfig overrides the provider breakers' defaults (package breaker).
type BreakerConfig struct {
	Off         bool     `json:"off,omitempty"`
	Failures    uint32   `json:"failures,omitempty"`
	Ratio       float64  `json:"ratio,omitempty"`
	MinRequests uint32   `json:"min_requests,omitempty"`
	Window      Duration `json:"window,omitempty"`
	OpenTimeout Duration `json:"open_timeout,omitempty"`
	Jitter      float64  `json:"jitter,omitempty"`
}

// CacheConfig sizes the response cache.
type CacheConfig struct {
	Off        bool     `json:"off,omitempty"`
	TTL        Duration `json:"ttl,omitempty"`
	MaxEntries int      `json:"max_entries,omitempty"`
}

// ShedConfig tunes shedding at the proxy: a call whose time left cannot cover the
// provider's expected time to first token plus its requested decode (max_tokens at the
// provider's decode rate) is refused with DEADLINE_EXCEEDED before any upstream request.
type ShedConfig struct {
	Off bool `json:"off,omitempty"`
	// Quantile of the observed latencies used as the expectation; DefaultShedQuantile.
	Quantile float64 `json:"quantile,omitempty"`
}

// Duration is a time.Duration written as a Go duration string ("250ms", "5s"), the
// format of the retry config file too.
type Duration = retry.Duration

var nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,62}$`)

// Target is one provider/model of a chain.
type Target struct{ Provider, Model string }

func (t Target) String() string { return t.Provider + "/" + t.Model }

// ParseTarget splits "provider/model". The model part may itself contain '/'.
func ParseTarget(s string) (Target, error) {
	p, m, ok := strings.Cut(s, "/")
	if !ok || p == "" || m == "" {
		return Target{}, fmt.Errorf("%q is not provider/model", s)
	}
	return Target{p, m}, nil
}

// LoadFile reads and validates a providers file.
func LoadFile(path string) (*File, error) {
	b, err := os.ReadFile(path) //nolint:gosec // the operator names the file (--providers-config)
	if err != nil {
		return nil, err
	}
	f, err := ParseFile(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return f, nil
}

// ParseFile decodes a providers file strictly (unknown fields are errors) and validates it.
func ParseFile(b []byte) (*File, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var f File
	if err := dec.Decode(&f); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("trailing data after the JSON object")
	}
	return &f, f.Validate()
}

// Validate checks the file: unique provider names, parseable URLs, key sources, chains
// that name configured providers and models, breaker settings.
func (f *File) Validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	models := map[string]map[string]bool{}
	for i, p := range f.Providers {
		at := fmt.Sprintf("providers[%d]", i)
		switch {
		case !nameRE.MatchString(p.Name):
			bad("%s.name %q: lowercase letters, digits, '-' and '_', at most 63", at, p.Name)
		case p.Name == SimModel:
			bad("%s.name %q is reserved for the built-in model", at, p.Name)
		case models[p.Name] != nil:
			bad("%s.name %q: duplicate provider", at, p.Name)
		}
		u, err := url.Parse(p.BaseURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("%s.base_url %q: an http or https URL is required", at, p.BaseURL)
		}
		if p.APIKeyEnv != "" && p.APIKeyFile != "" {
			bad("%s: api_key_env and api_key_file are exclusive", at)
		}
		if len(p.Models) == 0 {
			bad("%s.models: at least one model is required", at)
		}
		if p.TokensPerSecond < 0 {
			bad("%s.expected_tokens_per_second must not be negative", at)
		}
		if p.Timeout < 0 || p.TTFT < 0 {
			bad("%s: timeout and expected_ttft must not be negative", at)
		}
		ms := map[string]bool{}
		for _, m := range p.Models {
			if m == "" {
				bad("%s.models: empty model name", at)
			}
			ms[m] = true
		}
		models[p.Name] = ms
	}
	check := func(at, s string) {
		t, err := ParseTarget(s)
		if err != nil {
			bad("%s: %v", at, err)
			return
		}
		ms, ok := models[t.Provider]
		if !ok {
			bad("%s: unknown provider %q", at, t.Provider)
			return
		}
		if !ms[t.Model] {
			bad("%s: provider %q has no model %q (its models: %s)", at, t.Provider, t.Model, strings.Join(keys(ms), ", "))
		}
	}
	for name, a := range f.Models {
		at := fmt.Sprintf("models[%q]", name)
		if name == "" || name == SimModel || strings.Contains(name, "/") {
			bad("%s: an alias is a non-empty name without '/', other than %q", at, SimModel)
		}
		if len(a.Chain) == 0 {
			bad("%s.chain: at least one provider/model is required", at)
		}
		for j, s := range a.Chain {
			check(fmt.Sprintf("%s.chain[%d]", at, j), s)
		}
		if a.DegradeTo != "" {
			check(at+".degrade_to", a.DegradeTo)
		}
	}
	if err := f.BreakerSettings().Validate(); err != nil {
		bad("breaker: %v", err)
	}
	if c := f.Cache; c != nil && (c.MaxEntries < 0 || c.TTL < 0) {
		bad("cache.max_entries and cache.ttl must not be negative")
	}
	if s := f.Shed; s != nil && (s.Quantile < 0 || s.Quantile >= 1) {
		bad("shed.quantile must be in [0, 1)")
	}
	return errors.Join(errs...)
}

// BreakerSettings returns the provider breakers' configuration.
func (f *File) BreakerSettings() breaker.Config {
	var c breaker.Config
	if b := f.Breaker; b != nil {
		c = breaker.Config{Off: b.Off, ConsecutiveFailures: b.Failures, FailureRatio: b.Ratio, MinRequests: b.MinRequests,
			Window: time.Duration(b.Window), OpenTimeout: time.Duration(b.OpenTimeout), Jitter: b.Jitter}
	}
	return c.WithDefaults()
}

// APIKey reads the provider's key from its environment variable or file.
func (p ProviderConfig) APIKey(getenv func(string) string) (string, error) {
	switch {
	case p.APIKeyEnv != "":
		k := getenv(p.APIKeyEnv)
		if k == "" {
			return "", fmt.Errorf("provider %q: environment variable %s is empty", p.Name, p.APIKeyEnv)
		}
		return k, nil
	case p.APIKeyFile != "":
		b, err := os.ReadFile(p.APIKeyFile)
		if err != nil {
			return "", fmt.Errorf("provider %q: api_key_file: %w", p.Name, err)
		}
		k := strings.TrimSpace(string(b))
		if k == "" {
			return "", fmt.Errorf("provider %q: api_key_file %s is empty", p.Name, p.APIKeyFile)
		}
		return k, nil
	}
	return "", nil
}

func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
