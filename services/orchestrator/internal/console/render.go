package console

import (
	"bytes"
	"fmt"
	"html/template"
	"io"
	"net/http"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// pageNames are the templates under templates/ that are whole pages; each is parsed with
// layout.html and the shared fragments.
var pageNames = []string{"signin", "runs", "run", "health", "deadletters", "error"}

var funcs = template.FuncMap{
	"ms":    fmtMS,
	"short": func(s string) string { return s[:min(len(s), 8)] },
	"when": func(t time.Time) string {
		if t.IsZero() {
			return "–"
		}
		return t.UTC().Format("2006-01-02 15:04:05")
	},
	"ts": func(t *timestamppb.Timestamp) string {
		if t == nil {
			return "–"
		}
		return t.AsTime().UTC().Format("2006-01-02 15:04:05.000")
	},
	"dur": func(d *durationpb.Duration) string {
		if d == nil {
			return "–"
		}
		return d.AsDuration().Round(time.Millisecond).String()
	},
	"since": func(a, b time.Time) string {
		if a.IsZero() || b.IsZero() {
			return "–"
		}
		return b.Sub(a).Round(time.Millisecond).String()
	},
	"indent": func(depth int) string { return strings.Repeat("\u00a0\u00a0", depth) },
	"f1":     func(v float64) string { return fmt.Sprintf("%.1f", v) },
}

func parsePages() (map[string]*template.Template, error) {
	out := map[string]*template.Template{}
	for _, p := range pageNames {
		t, err := template.New(p).Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/parts.html", "templates/"+p+".html")
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", p, err)
		}
		out[p] = t
	}
	return out, nil
}

// render writes a whole page: the layout around the page's content. data's Title names
// the page; the user (nil before sign-in) and its CSRF token are added.
func (h *Handler) render(w http.ResponseWriter, r *http.Request, page string, u *user, data map[string]any) {
	if data == nil {
		data = map[string]any{}
	}
	data["User"] = u
	if u != nil {
		data["CSRF"] = h.seal.token(u.ID)
	}
	h.write(w, page, "layout", data)
}

// renderFragment writes one named template of the run page (its live part, the list's
// rows) without the layout.
func (h *Handler) renderFragment(w http.ResponseWriter, name string, u *user, data any) {
	page := "run"
	if name == "runrows" {
		page = "runs"
		if m, ok := data.(map[string]any); ok {
			m["User"] = u
		}
	}
	h.write(w, page, name, data)
}

func (h *Handler) write(w http.ResponseWriter, page, name string, data any) {
	var b bytes.Buffer
	if err := h.pages[page].ExecuteTemplate(&b, name, data); err != nil {
		h.cfg.Log.Error("console: render", "page", page, "template", name, "error", err.Error())
		http.Error(w, "internal error", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, _ = io.Copy(w, &b)
}
