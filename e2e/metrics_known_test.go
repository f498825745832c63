package e2e

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// knownRow is one row of docs/metrics.md's "Known in advance" table: the series of name
// with every combination of the labels' values, served at 0 from the start by where.
type knownRow struct {
	line      string
	name      string
	labels    map[string][]string
	value     float64 // the series' value at the start (0 unless the row says)
	where     []string
	providers bool // a modelproxy with the section's --providers-config
	nats      bool // an orchestrator with --nats (e2e/outbox_test.go)
}

var (
	knownSelector = regexp.MustCompile("^`([a-z_:][a-z0-9_:]*)\\{(.*)\\}(?: ([0-9.]+))?`$")
	knownMatcher  = regexp.MustCompile(`([a-z_]+)="([^"]*)"`)
)

// docKnown parses the "Known in advance" section of docs/metrics.md: its table and its
// providers configuration (the json block).
func docKnown(t *testing.T) (rows []knownRow, providersJSON string) {
	t.Helper()
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(repo, "docs", "metrics.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	in, inJSON := false, false
	var js strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "## ") {
			in = strings.HasPrefix(line, "## Known in advance")
			continue
		}
		if !in {
			continue
		}
		switch {
		case strings.HasPrefix(line, "```json"):
			inJSON = true
			continue
		case strings.HasPrefix(line, "```"):
			inJSON = false
			continue
		case inJSON:
			js.WriteString(line + "\n")
			continue
		case !strings.HasPrefix(line, "| `"):
			continue
		}
		// Cells are split at the pipes that are not escaped (\| inside a selector).
		cells := strings.Split(strings.ReplaceAll(strings.Trim(line, "|"), `\|`, "\x00"), "|")
		if len(cells) != 2 {
			t.Fatalf("docs/metrics.md: known row %q: want 2 cells", line)
		}
		m := knownSelector.FindStringSubmatch(strings.TrimSpace(cells[0]))
		if m == nil {
			t.Fatalf("docs/metrics.md: known row %q: want `name{label=\"v1\\|v2\",...}`", line)
		}
		r := knownRow{line: line, name: m[1], labels: map[string][]string{}}
		if m[3] != "" {
			if r.value, err = strconv.ParseFloat(m[3], 64); err != nil {
				t.Fatalf("docs/metrics.md: known row %q: %v", line, err)
			}
		}
		for _, lm := range knownMatcher.FindAllStringSubmatch(m[2], -1) {
			r.labels[lm[1]] = strings.Split(lm[2], "\x00")
		}
		where := cells[1]
		for _, s := range services {
			if strings.Contains(where, s) {
				r.where = append(r.where, s)
			}
		}
		r.providers, r.nats = strings.Contains(where, "--providers-config"), strings.Contains(where, "--nats")
		if len(r.labels) == 0 || len(r.where) == 0 {
			t.Fatalf("docs/metrics.md: cannot read the known row %q", line)
		}
		rows = append(rows, r)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(rows) < 20 || js.Len() == 0 {
		t.Fatalf("docs/metrics.md: %d known rows and a providers configuration of %d bytes", len(rows), js.Len())
	}
	return rows, js.String()
}

// series expands a row into the label sets of its series.
func (r knownRow) series() []map[string]string {
	out := []map[string]string{{}}
	for name, values := range r.labels {
		var next []map[string]string
		for _, partial := range out {
			for _, v := range values {
				m := map[string]string{name: v}
				for k, pv := range partial {
					m[k] = pv
				}
				next = append(next, m)
			}
		}
		out = next
	}
	return out
}

// checkKnown reports every series of rows (those for service) missing from pg or not 0.
func checkKnown(t *testing.T, service string, pg page, rows []knownRow) {
	t.Helper()
	for _, r := range rows {
		if !contains(r.where, service) {
			continue
		}
		for _, want := range r.series() {
			m := findSeries(pg.mfs[r.name], want)
			switch {
			case m == nil:
				t.Errorf("%s right after start: no %s%v (docs/metrics.md: %s)", service, r.name, want, r.line)
			case m.GetCounter().GetValue()+m.GetGauge().GetValue()+float64(m.GetHistogram().GetSampleCount()) != r.value:
				t.Errorf("%s right after start: %s%v is not %v: %v", service, r.name, want, r.value, m)
			}
		}
	}
}

func findSeries(mf *dto.MetricFamily, want map[string]string) *dto.Metric {
	if mf == nil {
		return nil
	}
	for _, m := range mf.GetMetric() {
		got := map[string]string{}
		for _, l := range m.GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		if len(got) != len(want) {
			continue
		}
		match := true
		for k, v := range want {
			if got[k] != v {
				match = false
			}
		}
		if match {
			return m
		}
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Right after a mesh is ready, each service's /metrics serves every series docs/metrics.md
// lists as known in advance, at 0: the mesh of `curfew up`, its modelproxy with the
// section's --providers-config.
func TestMetricsKnownInAdvance(t *testing.T) {
	t.Parallel()
	rows, providers := docKnown(t)
	m := startProviderMesh(t, providers, nil)
	var checked []knownRow
	for _, r := range rows {
		if !r.nats {
			checked = append(checked, r)
		}
	}
	for _, s := range services {
		checkKnown(t, s, scrapeParsed(t, m, s), checked)
	}
}
