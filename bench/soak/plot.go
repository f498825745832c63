package soak

import (
	"fmt"
	"path/filepath"
	"sort"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// Plots writes the report's PNG plots into dir and returns their paths:
//
//   - latency.png: per second of the load, the Tools runs' latency p50 and p99 and the
//     cancel latency p99 (to the last decoder stopped);
//   - throughput.png: runs ended per second;
//   - heap.png, rss.png, goroutines.png: each process over time (a gap is a process
//     down: killed, restarting).
func (r *Report) Plots(dir string) ([]string, error) {
	var paths []string
	save := func(name string, p *plot.Plot) error {
		path := filepath.Join(dir, name)
		if err := p.Save(10*vg.Inch, 4*vg.Inch, path); err != nil {
			return fmt.Errorf("plot %s: %w", name, err)
		}
		paths = append(paths, path)
		return nil
	}

	lat := newPlot("Latency per second of the load", "seconds since the start", "milliseconds")
	var p50, p99, c99, ended plotter.XYs
	for _, s := range r.Series {
		if s.ToolsP50 > 0 {
			p50 = append(p50, plotter.XY{X: s.At, Y: s.ToolsP50})
			p99 = append(p99, plotter.XY{X: s.At, Y: s.ToolsP99})
		}
		if s.CancelP99 > 0 {
			c99 = append(c99, plotter.XY{X: s.At, Y: s.CancelP99})
		}
		ended = append(ended, plotter.XY{X: s.At, Y: float64(s.Ended)})
	}
	if err := addLines(lat, "tools run p50", p50, "tools run p99", p99, "cancel to last decoder p99", c99); err != nil {
		return nil, err
	}
	if err := save("latency.png", lat); err != nil {
		return nil, err
	}
	tp := newPlot("Runs ended per second", "seconds since the start", "runs")
	if err := addLines(tp, "runs ended", ended); err != nil {
		return nil, err
	}
	if err := save("throughput.png", tp); err != nil {
		return nil, err
	}

	for _, m := range []struct {
		file, title, unit string
		v                 func(Sample) float64
	}{
		{"heap.png", "Heap in use per process", "MiB", func(s Sample) float64 { return s.HeapInuse / (1 << 20) }},
		{"rss.png", "Resident memory per process", "MiB", func(s Sample) float64 { return s.RSS / (1 << 20) }},
		{"goroutines.png", "Goroutines per process", "goroutines", func(s Sample) float64 { return s.Goroutines }},
	} {
		p := newPlot(m.title, "seconds since the start", m.unit)
		by := map[string]plotter.XYs{}
		for _, s := range r.Samples {
			if s.Up {
				by[s.Process] = append(by[s.Process], plotter.XY{X: s.At.Sub(r.Started).Seconds(), Y: m.v(s)})
			}
		}
		names := make([]string, 0, len(by))
		for n := range by {
			names = append(names, n)
		}
		sort.Strings(names)
		var lines []any
		for _, n := range names {
			lines = append(lines, n, by[n])
		}
		if err := addLines(p, lines...); err != nil {
			return nil, err
		}
		if err := save(m.file, p); err != nil {
			return nil, err
		}
	}
	return paths, nil
}

func newPlot(title, x, y string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = x
	p.Y.Label.Text = y
	p.Y.Min = 0
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	return p
}

// addLines adds name, XYs pairs, skipping empty series (a plot with no point is still
// drawn, with its axes).
func addLines(p *plot.Plot, pairs ...any) error {
	var vs []any
	for i := 0; i+1 < len(pairs); i += 2 {
		if xys, ok := pairs[i+1].(plotter.XYs); ok && len(xys) > 0 {
			vs = append(vs, pairs[i], xys)
		}
	}
	if len(vs) == 0 {
		return nil
	}
	return plotutil.AddLines(p, vs...)
}
