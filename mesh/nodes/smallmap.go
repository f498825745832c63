package nodes

import "iter"

// smallMap maps node ids to V, holding its first entry inline: most runs have one node on
// a given process (a tool, a decoder, the root), and a Go map costs a few hundred bytes
// even for one entry, for as long as the run is kept.
type smallMap[V any] struct {
	k   string
	v   V
	has bool
	m   map[string]V // the other entries; nil until there are any
}

func (s *smallMap[V]) get(k string) (V, bool) {
	if s.has && s.k == k {
		return s.v, true
	}
	v, ok := s.m[k]
	return v, ok
}

func (s *smallMap[V]) set(k string, v V) {
	if s.has && s.k == k {
		s.v = v
		return
	}
	if _, ok := s.m[k]; ok {
		s.m[k] = v
		return
	}
	if !s.has {
		s.k, s.v, s.has = k, v, true
		return
	}
	if s.m == nil {
		s.m = make(map[string]V)
	}
	s.m[k] = v
}

func (s *smallMap[V]) del(k string) {
	if s.has && s.k == k {
		var zero V
		s.k, s.v, s.has = "", zero, false
		return
	}
	delete(s.m, k)
	if len(s.m) == 0 {
		s.m = nil
	}
}

func (s *smallMap[V]) all() iter.Seq2[string, V] {
	return func(yield func(string, V) bool) {
		if s.has && !yield(s.k, s.v) {
			return
		}
		for k, v := range s.m {
			if !yield(k, v) {
				return
			}
		}
	}
}
