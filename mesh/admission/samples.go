package admission

import (
	"slices"
	"time"
)

// ServiceSamples is how many recent service times of completed runs are kept per class;
// the class's expected service time is their median.
const ServiceSamples = 16

// maxClasses bounds the classes tracked; runs of further classes have no estimate (0)
// unless they declare Expected.
const maxClasses = 1024

// samples is a ring of a class's recent service times and their median.
type samples struct {
	buf      [ServiceSamples]time.Duration
	n, next  int
	estimate time.Duration
}

func (s *samples) add(d time.Duration) {
	s.buf[s.next] = d
	s.next = (s.next + 1) % ServiceSamples
	if s.n < ServiceSamples {
		s.n++
	}
	var sorted [ServiceSamples]time.Duration
	copy(sorted[:], s.buf[:s.n])
	slices.Sort(sorted[:s.n])
	s.estimate = sorted[s.n/2] // the upper median: slightly conservative
}

// observeService records a completed run's service time for its class.
func (c *Controller) observeService(class string, d time.Duration) {
	s := c.classes[class]
	if s == nil {
		if len(c.classes) >= maxClasses {
			return
		}
		s = &samples{}
		c.classes[class] = s
	}
	s.add(d)
}
