package service

import (
	"context"
	"fmt"
	"net"
)

// listen opens the gRPC, admin and health listeners; on an error, those already open
// are closed.
func (rt *Runtime) listen(ctx context.Context) error {
	o := rt.Opts
	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "tcp", o.Addr)
	if err != nil {
		return fmt.Errorf("listen on --addr %s: %w", o.Addr, err)
	}
	rt.lis = lis
	if o.AdminAddr != "" {
		if rt.admin, err = lc.Listen(ctx, "tcp", o.AdminAddr); err != nil {
			_ = lis.Close()
			return fmt.Errorf("listen on --admin-addr %s: %w", o.AdminAddr, err)
		}
	}
	if err := rt.listenHealth(ctx); err != nil {
		rt.closeListeners()
		return err
	}
	return nil
}

// closeListeners closes the listeners listen opened, when New fails after it.
func (rt *Runtime) closeListeners() {
	_ = rt.lis.Close()
	if rt.admin != nil {
		_ = rt.admin.Close()
	}
	if rt.healthLis != nil {
		_ = rt.healthLis.Close()
	}
}

// listenHealth opens --health-addr, where New then serves grpc.health.v1 only (the
// runtime's health.Server) in plaintext, for probes that cannot do mTLS (Kubernetes'
// gRPC probes): no reflection, no other service.
func (rt *Runtime) listenHealth(ctx context.Context) error {
	if rt.Opts.HealthAddr == "" {
		return nil
	}
	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "tcp", rt.Opts.HealthAddr)
	if err != nil {
		return fmt.Errorf("listen on --health-addr %s: %w", rt.Opts.HealthAddr, err)
	}
	rt.healthLis = lis
	return nil
}

// HealthAddr returns the bound --health-addr, or "".
func (rt *Runtime) HealthAddr() string {
	if rt.healthLis == nil {
		return ""
	}
	return rt.healthLis.Addr().String()
}

// Addr returns the bound gRPC address.
func (rt *Runtime) Addr() string { return rt.lis.Addr().String() }

// AdminAddr returns the bound admin address, or "".
func (rt *Runtime) AdminAddr() string {
	if rt.admin == nil {
		return ""
	}
	return rt.admin.Addr().String()
}
