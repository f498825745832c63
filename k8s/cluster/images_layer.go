package cluster

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// imageEpoch is the time of every image and file, so that a rebuild of the same files is the same image.
var imageEpoch = time.Unix(0, 0).UTC()

// layer is the single layer of an image: its entries by absolute path. Missing parent
// directories are added root-owned with mode 0755.
type layer map[string]layerEntry

// layerEntry is a directory, a regular file (copied from src, or data), or a symbolic link.
type layerEntry struct {
	typ      byte  // tar.TypeDir, tar.TypeReg or tar.TypeSymlink
	mode     int64 // permission bits, with setgid (0o2000) and sticky (0o1000) as in tar
	uid, gid int
	src      string
	data     []byte
	link     string
}

// dir adds a directory, unless the path is already in the layer.
func (l layer) dir(p string, mode int64, uid, gid int) {
	if _, ok := l[p]; !ok {
		l[p] = layerEntry{typ: tar.TypeDir, mode: mode, uid: uid, gid: gid}
	}
}

// file adds a root-owned file with the given content.
func (l layer) file(p string, mode int64, data string) {
	l[p] = layerEntry{typ: tar.TypeReg, mode: mode, data: []byte(data)}
}

// copy adds a root-owned file with the content of the host file src.
func (l layer) copy(src, p string, mode int64) {
	l[p] = layerEntry{typ: tar.TypeReg, mode: mode, src: src}
}

// addHost adds the host's file or directory p at the same path, and every symbolic link on
// the way as a link (merged /usr's /lib -> usr/lib, a library's versioned names), so that p
// resolves in the image as it does here.
func (l layer) addHost(p string) error {
	dir, err := l.addHostDir(filepath.Dir(filepath.Clean(p)))
	if err != nil {
		return err
	}
	p = filepath.Join(dir, filepath.Base(p))
	fi, err := os.Lstat(p)
	switch {
	case err != nil:
		return fmt.Errorf("cluster: %w", err)
	case fi.Mode()&fs.ModeSymlink != 0:
		target, err := os.Readlink(p)
		if err != nil {
			return fmt.Errorf("cluster: %w", err)
		}
		l[p] = layerEntry{typ: tar.TypeSymlink, mode: 0o777, link: target}
		if !filepath.IsAbs(target) {
			target = filepath.Join(dir, target)
		}
		return l.addHost(target)
	case fi.IsDir():
		l.dir(p, int64(fi.Mode().Perm()), 0, 0)
	case fi.Mode().IsRegular():
		l.copy(p, p, int64(fi.Mode().Perm()))
	default:
		return fmt.Errorf("cluster: %s: not a file, directory or symbolic link", p)
	}
	return nil
}

// addHostDir adds the host's directory dir with its parents and the symbolic links on the way,
// and returns the directory's real path.
func (l layer) addHostDir(dir string) (string, error) {
	if dir == "/" {
		return dir, nil
	}
	parent, err := l.addHostDir(filepath.Dir(dir))
	if err != nil {
		return "", err
	}
	dir = filepath.Join(parent, filepath.Base(dir))
	fi, err := os.Lstat(dir)
	switch {
	case err != nil:
		return "", fmt.Errorf("cluster: %w", err)
	case fi.Mode()&fs.ModeSymlink != 0:
		target, err := os.Readlink(dir)
		if err != nil {
			return "", fmt.Errorf("cluster: %w", err)
		}
		l[dir] = layerEntry{typ: tar.TypeSymlink, mode: 0o777, link: target}
		if !filepath.IsAbs(target) {
			target = filepath.Join(parent, target)
		}
		return l.addHostDir(filepath.Clean(target))
	case !fi.IsDir():
		return "", fmt.Errorf("cluster: %s: not a directory", dir)
	}
	l.dir(dir, int64(fi.Mode().Perm()), 0, 0)
	return dir, nil
}

// addTree adds the host's directory tree dir, root-owned, but for the paths skip returns true for
// and the symbolic links to absolute paths (which would not resolve in the image). It returns
// the regular files added.
func (l layer) addTree(dir string, skip func(string) bool) ([]string, error) {
	dir, err := l.addHostDir(dir)
	if err != nil {
		return nil, err
	}
	var files []string
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if skip != nil && skip(p) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			l.dir(p, int64(fi.Mode().Perm()), 0, 0)
		case d.Type()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			if !filepath.IsAbs(target) {
				l[p] = layerEntry{typ: tar.TypeSymlink, mode: 0o777, link: target}
			}
		case d.Type().IsRegular():
			l.copy(p, p, int64(fi.Mode().Perm()))
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("cluster: %w", err)
	}
	return files, nil
}

// write writes the layer as a tar stream, sorted, with imageEpoch as every time.
func (l layer) write(ctx context.Context, w io.Writer) error {
	for _, p := range slices.Collect(maps.Keys(l)) {
		for d := filepath.Dir(p); d != "/"; d = filepath.Dir(d) {
			if e, ok := l[d]; ok && e.typ == tar.TypeSymlink {
				return fmt.Errorf("cluster: image file %s is under the symbolic link %s", p, d)
			}
			l.dir(d, 0o755, 0, 0)
		}
	}
	tw := tar.NewWriter(w)
	for _, p := range slices.Sorted(maps.Keys(l)) {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := l.writeEntry(tw, p); err != nil {
			return fmt.Errorf("cluster: image file %s: %w", p, err)
		}
	}
	return tw.Close()
}

// writeEntry writes the entry of path p.
func (l layer) writeEntry(tw *tar.Writer, p string) error {
	e := l[p]
	h := &tar.Header{
		Typeflag: e.typ, Name: strings.TrimPrefix(p, "/"), Linkname: e.link, Mode: e.mode,
		Uid: e.uid, Gid: e.gid, ModTime: imageEpoch, Size: int64(len(e.data)),
	}
	switch {
	case e.typ == tar.TypeDir:
		h.Name += "/"
	case e.src != "":
		f, err := os.Open(e.src)
		if err != nil {
			return err
		}
		defer func() { _ = f.Close() }()
		fi, err := f.Stat()
		if err != nil {
			return err
		}
		h.Size = fi.Size()
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err = io.Copy(tw, f)
		return err
	}
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	_, err := tw.Write(e.data)
	return err
}

// writeImage writes the linux/amd64 image of the layer and config, tagged ref, as a
// docker-archive tarball (the format of docker save, which ctr images import reads) to out.
func writeImage(ctx context.Context, l layer, config v1.Config, ref, out string) (err error) {
	tag, err := name.NewTag(ref)
	if err != nil {
		return fmt.Errorf("cluster: image reference: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(out), ".layer-*.tar.gz")
	if err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	zw, _ := gzip.NewWriterLevel(tmp, gzip.BestSpeed)
	err = l.write(ctx, zw)
	if err == nil {
		err = zw.Close()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("cluster: %s: layer: %w", ref, err)
	}
	ly, err := tarball.LayerFromFile(tmp.Name())
	if err != nil {
		return fmt.Errorf("cluster: %s: layer: %w", ref, err)
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{
		Layer:   ly,
		History: v1.History{Created: v1.Time{Time: imageEpoch}, CreatedBy: "curfew k8s/cluster", Comment: ref},
	})
	if err != nil {
		return fmt.Errorf("cluster: %s: %w", ref, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return fmt.Errorf("cluster: %s: %w", ref, err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Created, cf.Config = imageOS, imageArch, v1.Time{Time: imageEpoch}, config
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return fmt.Errorf("cluster: %s: %w", ref, err)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := tarball.WriteToFile(out+".tmp", tag, img); err != nil {
		_ = os.Remove(out + ".tmp")
		return fmt.Errorf("cluster: %s: %w", ref, err)
	}
	if err := os.Rename(out+".tmp", out); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	return nil
}

// account is a user, with its group of the same id and name, of an image's /etc/passwd and /etc/group.
type account struct {
	name string
	id   int
	home string
	mode int64 // of home
}

// distrolessStatic adds what curfew's services rely on from their Dockerfiles' runtime base,
// gcr.io/distroless/static-debian12:nonroot, which cannot be pulled here: its /etc/passwd and
// /etc/group (root 0, nobody 65534, nonroot 65532 with home /home/nonroot), /etc/nsswitch.conf,
// the CA certificates at /etc/ssl/certs/ca-certificates.crt (this machine's, also Debian 12's
// ca-certificates), /tmp (1777) and the time zones at /usr/share/zoneinfo. Its config's PATH,
// SSL_CERT_FILE and WorkingDir are ServiceImage's. Left out: /etc/os-release, the packages'
// licenses and dpkg status.
func distrolessStatic(l layer) error {
	if err := baseFiles(l, nonrootAccount); err != nil {
		return err
	}
	_, err := l.addTree("/usr/share/zoneinfo", nil)
	return err
}

// baseFiles adds the files of a minimal Debian-like root: /etc/passwd and /etc/group with root,
// nobody and the accounts (their homes too), /etc/nsswitch.conf, the CA certificates, /root and /tmp.
func baseFiles(l layer, accounts ...account) error {
	passwd := "root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n"
	group := "root:x:0:\nnobody:x:65534:\n"
	for _, a := range accounts {
		passwd += fmt.Sprintf("%s:x:%d:%d:%s:%s:/sbin/nologin\n", a.name, a.id, a.id, a.name, a.home)
		group += fmt.Sprintf("%s:x:%d:\n", a.name, a.id)
		l.dir(a.home, a.mode, a.id, a.id)
	}
	l.file("/etc/passwd", 0o644, passwd)
	l.file("/etc/group", 0o644, group)
	l.file("/etc/nsswitch.conf", 0o644, "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n")
	l.dir("/root", 0o700, 0, 0)
	l.dir("/tmp", 0o1777, 0, 0)
	if _, err := os.Stat(caCerts); err != nil {
		return fmt.Errorf("cluster: CA certificates (Debian's ca-certificates): %w", err)
	}
	l.copy(caCerts, caCerts, 0o644)
	return nil
}
