package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// nginxConf is a plain nginx reverse proxy in front of one backend, as an
// operator would put it there: keep-alive connections to the backend,
// responses passed on as they come (a stream's chunks unbuffered), no
// logs. Its placeholders: the prefix directory, the listen port, the
// backend's host:port.
const nginxConf = `worker_processes 2;
user root;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log crit;
events { worker_connections 4096; }
http {
	access_log off;
	client_body_temp_path %[1]s/body;
	proxy_temp_path %[1]s/proxy;
	fastcgi_temp_path %[1]s/fastcgi;
	uwsgi_temp_path %[1]s/uwsgi;
	scgi_temp_path %[1]s/scgi;
	upstream backend { server %[3]s; keepalive 512; }
	server {
		listen 127.0.0.1:%[2]d;
		location / {
			proxy_pass http://backend;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
			proxy_buffering off;
		}
	}
}
`

// startNginx runs nginx, when the machine has it, as a second floor beside
// the bare Go proxy: what a proxy that is not written in Go adds on this
// machine. It returns the proxy's base URL and a reading of its processes'
// CPU time, or "" when nginx is not installed.
func startNginx(tb testing.TB, backend string) (string, func() time.Duration) {
	tb.Helper()
	bin, err := exec.LookPath("nginx")
	if err != nil {
		return "", nil
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir := tb.TempDir()
	conf := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(conf, fmt.Appendf(nil, nginxConf, dir, port, strings.TrimPrefix(backend, "http://")), 0o644); err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command(bin, "-p", dir, "-c", conf, "-g", "daemon off;")
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	})
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	waitReady(tb, url+"/v1/models") // the backend's, through nginx
	master := cmd.Process.Pid
	return url, func() time.Duration {
		// The master and its workers (Linux's list of a task's children).
		d, err := procCPU(master)
		if err != nil {
			tb.Fatal(err)
		}
		kids, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", master, master))
		for _, f := range strings.Fields(string(kids)) {
			pid, _ := strconv.Atoi(f)
			if c, err := procCPU(pid); err == nil {
				d += c
			}
		}
		return d
	}
}
