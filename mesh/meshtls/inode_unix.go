//go:build unix

package meshtls

import (
	"os"
	"syscall"
)

// inode returns fi's inode number.
func inode(fi os.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Ino) //nolint:unconvert // int64 or uint64 by platform
	}
	return 0
}
