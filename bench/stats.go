package bench

import (
	"bufio"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Dist is a sample of durations.
type Dist []time.Duration

// Quantile returns the q-quantile (0 < q <= 1) by the nearest-rank method: the smallest
// sample such that at least q of all samples are at or below it. With n samples, the
// p99 is the maximum whenever n < 100.
func (d Dist) Quantile(q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	rank := int(math.Ceil(q * float64(len(s))))
	rank = min(max(rank, 1), len(s))
	return s[rank-1]
}

// Max returns the largest sample.
func (d Dist) Max() time.Duration {
	if len(d) == 0 {
		return 0
	}
	return slices.Max(d)
}

// Min returns the smallest sample.
func (d Dist) Min() time.Duration {
	if len(d) == 0 {
		return 0
	}
	return slices.Min(d)
}

// ms formats a duration in milliseconds with two decimals.
func ms(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 2, 64) }

// ms1 formats a duration in milliseconds with one decimal.
func ms1(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 1, 64) }

// us formats a duration in microseconds with one decimal.
func us(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e3, 'f', 1, 64) }

// Memory is one process's memory figures in bytes.
type Memory struct {
	RSS int64 // smaps_rollup Rss
	PSS int64 // smaps_rollup Pss
}

// ReadMemory reads /proc/<pid>/smaps_rollup.
func ReadMemory(pid int) (Memory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return Memory{}, err
	}
	defer f.Close()
	var m Memory
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fs := strings.Fields(v)
		if len(fs) != 2 || fs[1] != "kB" {
			continue
		}
		n, err := strconv.ParseInt(fs[0], 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "Rss":
			m.RSS = n * 1024
		case "Pss":
			m.PSS = n * 1024
		}
	}
	if err := sc.Err(); err != nil {
		return Memory{}, err
	}
	if m.RSS == 0 {
		return Memory{}, fmt.Errorf("pid %d: no Rss in smaps_rollup", pid)
	}
	return m, nil
}

// PromValue returns the value of an unlabelled Prometheus sample in a text exposition.
func PromValue(exposition, name string) (float64, bool) {
	for _, line := range strings.Split(exposition, "\n") {
		if strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, " ")
		if !ok || k != name {
			continue
		}
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil {
			return 0, false
		}
		return f, true
	}
	return 0, false
}

// CPUTime returns the CPU time the process has used so far, summed over its threads from
// /proc/<pid>/task/*/schedstat (nanosecond resolution, unlike the tick-based stat files).
// Threads that exited are not counted, which Go's long-lived Ms make rare.
func CPUTime(pid int) (time.Duration, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, err
	}
	var sum time.Duration
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, t.Name()))
		if err != nil {
			continue // the thread exited
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			continue
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		sum += time.Duration(n)
	}
	return sum, nil
}

// MachineBusy returns the CPU time all CPUs of the machine have spent busy (neither idle
// nor waiting for I/O) since boot, from /proc/stat, at USER_HZ (10 ms) resolution.
func MachineBusy() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	var busy int64
	for i, v := range f[1:] {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, err
		}
		if i == 3 || i == 4 || i >= 8 { // idle, iowait; guest times are already in user
			continue
		}
		busy += n
	}
	return time.Duration(busy) * 10 * time.Millisecond, nil
}
