//go:build cgo

package gpu

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

const (
	defaultNVMLInterval = 2 * time.Second
	defaultCallWait     = 10 * time.Second
	defaultHotC         = 85

	// maxXIDs bounds GPU.XIDs; maxXIDCodes bounds the distinct codes kept
	// for health, which real drivers never approach.
	maxXIDs     = 16
	maxXIDCodes = 64

	// xidDegrades is how long a GPU stays Degraded after a non-critical
	// XID. Most are an application's fault reported by the driver (13, 31,
	// 43, 45: an illegal access, a process killed with work in flight, as
	// when vLLM restarts), not the GPU's, and once the GPU reports none
	// for this long it is Healthy again. Critical ones stay (assessGPU).
	xidDegrades = 10 * time.Minute

	// eventWait is how long one EventSet.Wait blocks in the driver. Wait
	// cannot be interrupted, so it bounds how long Run takes to stop.
	eventWait = 500 * time.Millisecond

	clockEventSymbol = "nvmlDeviceGetCurrentClocksEventReasons"
)

func (g GPU) clone() GPU {
	g.Throttle = slices.Clone(g.Throttle)
	g.XIDs = slices.Clone(g.XIDs)
	g.Reasons = slices.Clone(g.Reasons)
	return g
}

// NVMLBuilt reports whether this build can load NVML: true with cgo, where
// go-nvml opens libnvidia-ml at run time (OpenNVML reports it off when the
// driver is missing).
const NVMLBuilt = true

// criticalXID reports whether an XID means the GPU cannot be trusted until
// it is reset: double-bit ECC (48), page retirement or row remapping (63,
// 64), NVLink (74), fallen off the bus (79), high single-bit ECC rate (92),
// contained and uncontained ECC errors (94, 95).
func criticalXID(x uint64) bool {
	switch x {
	case 48, 63, 64, 74, 79, 92, 94, 95:
		return true
	}
	return false
}

// clockReasons names the clock-event bits GPU.Throttle reports. Idle,
// application-clock and display-clock settings are configuration, not
// pressure, so they are left out. The bit values are the same in the
// clock-event and the older throttle-reason APIs.
var clockReasons = []struct {
	bit      uint64
	name     string
	degrades bool
}{
	{nvml.ClocksEventReasonSwPowerCap, "sw_power_cap", false}, // normal at full load
	{nvml.ClocksThrottleReasonHwSlowdown, "hw_slowdown", true},
	{nvml.ClocksEventReasonSyncBoost, "sync_boost", false},
	{nvml.ClocksEventReasonSwThermalSlowdown, "sw_thermal", true},
	{nvml.ClocksThrottleReasonHwThermalSlowdown, "hw_thermal", true},
	{nvml.ClocksThrottleReasonHwPowerBrakeSlowdown, "hw_power_brake", true},
	{nvml.ClocksEventReasonBoardLimit, "board_limit", false},
	{nvml.ClocksEventReasonReliability, "reliability", false},
}

func throttleNames(bits uint64) []string {
	var names []string
	for _, r := range clockReasons {
		if bits&r.bit != 0 {
			names = append(names, r.name)
		}
	}
	return names
}

// NVML collects telemetry for every GPU on the machine.
type NVML struct {
	lib          nvml.Interface
	log          *slog.Logger
	interval     time.Duration
	hotC         uint32
	enabled      bool
	driver       string
	eventReasons bool // the driver has the clock-event API, not only the throttle one
	ran          atomic.Bool
	now          func() time.Time // the clock of readings and of XIDs' weight on health [time.Now]

	// refreshMu serialises reads of the devices with each other and with
	// shutdown; after shutdown the library must not be called.
	refreshMu sync.Mutex
	devs      []*nvmlDev
	closed    bool

	// flight is the background read's: closed when it returns; nil
	// before the first (refreshWithin).
	flightMu sync.Mutex
	flight   chan struct{}
	callWait time.Duration // NVMLConfig.CallWait

	mu    sync.Mutex
	gpus  []GPU             // latest snapshot, GPU i at index i; nil when disabled
	state []gpuState        // per GPU, what health is derived from besides the snapshot
	migs  map[string]string // MIG device UUID (upper case) → its GPU's UUID
}

// nvmlDev is what Refresh keeps between reads of one GPU; guarded by
// NVML.refreshMu.
type nvmlDev struct {
	handle        nvml.Device // nil until DeviceGetHandleByIndex succeeds
	uuid, name    string      // static, read once
	prevCorrected uint64
	haveCorrected bool
}

// gpuState is guarded by NVML.mu.
type gpuState struct {
	sig readSignals
	xid xidLog
}

// readSignals are the health inputs of one read that GPU does not show.
type readSignals struct {
	lost        nvml.Return // ERROR_GPU_IS_LOST or ERROR_RESET_REQUIRED from any read, else SUCCESS
	noHandle    nvml.Return // why the handle could not be obtained, else SUCCESS
	correctedUp uint64      // rise in corrected ECC errors since the previous read
}

type xidLog struct {
	recent []uint64 // the last maxXIDs codes, oldest first
	total  uint64
	// last is when each distinct code was last seen (at most maxXIDCodes
	// of them).
	last map[uint64]time.Time
}

func (l *xidLog) add(code uint64, now time.Time) {
	l.total++
	if len(l.recent) == maxXIDs {
		l.recent = slices.Delete(l.recent, 0, 1)
	}
	l.recent = append(l.recent, code)
	if l.last == nil {
		l.last = map[uint64]time.Time{}
	}
	if _, seen := l.last[code]; seen || len(l.last) < maxXIDCodes {
		l.last[code] = now
	}
}

// health returns, ascending, the codes that weigh on the GPU's health at
// now: every critical one seen since start, and the others seen within
// xidDegrades.
func (l *xidLog) health(now time.Time) []uint64 {
	var codes []uint64
	for code, at := range l.last {
		if criticalXID(code) || now.Sub(at) < xidDegrades {
			codes = append(codes, code)
		}
	}
	slices.Sort(codes)
	return codes
}

// OpenNVML initialises NVML through lib (nvml.New() when nil) and reads
// every GPU once, so GPUs has data before Run starts. It never fails: when
// the library is missing or does not initialise (no driver:
// ERROR_LIBRARY_NOT_FOUND, ERROR_DRIVER_NOT_LOADED, ...) or cannot count the
// GPUs, it returns a disabled *NVML and logs one info line saying why,
// because a machine without GPUs must run. An enabled NVML logs one info
// line with the driver version and GPU count. Run shuts NVML down when it
// returns; an NVML whose Run is never called keeps the library initialised.
// An initialised lib must answer Extensions, as go-nvml's library and its
// dgx mock servers do: the clock-event call is used where the driver has it,
// the older throttle-reason call otherwise.
func OpenNVML(lib nvml.Interface, cfg NVMLConfig) *NVML {
	if lib == nil {
		lib = nvml.New()
	}
	n := &NVML{
		lib:      lib,
		log:      cfg.Logger,
		interval: cfg.Interval,
		hotC:     cfg.HotC,
		now:      time.Now,
		callWait: cfg.CallWait,
	}
	if n.log == nil {
		n.log = slog.New(slog.DiscardHandler)
	}
	n.log = n.log.With("component", "nvml")
	if n.interval <= 0 {
		n.interval = defaultNVMLInterval
	}
	if n.hotC == 0 {
		n.hotC = defaultHotC
	}
	if n.callWait <= 0 {
		n.callWait = defaultCallWait
	}

	if ret := lib.Init(); ret != nvml.SUCCESS {
		n.log.Info("nvml off", "reason", ret.Error())
		return n
	}
	count, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		lib.Shutdown()
		n.log.Info("nvml off", "reason", "device count: "+ret.Error())
		return n
	}
	n.enabled = true
	if v, ret := lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		n.driver = v
	}
	n.eventReasons = lib.Extensions().LookupSymbol(clockEventSymbol) == nil
	n.devs = make([]*nvmlDev, count)
	for i := range n.devs {
		n.devs[i] = &nvmlDev{}
	}
	n.state = make([]gpuState, count)
	n.log.Info("nvml on", "driver", n.driver, "gpus", count)
	if !n.refreshWithin(n.callWait) {
		// A read that hangs in the driver must not hold the gateway's
		// start (or kvgate gpus): until it returns, GPUs is empty and a
		// backend on these GPUs counts as Degraded (not found by NVML).
		n.log.Warn("nvml: the first read of the GPUs has not returned; going on without it", "waited", n.callWait)
	}
	return n
}

// refreshWithin reads the GPUs on a goroutine of its own, or joins the
// read already running, and waits at most d for it: it reports whether
// the read returned.
func (n *NVML) refreshWithin(d time.Duration) bool {
	flight := n.startRefresh()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-flight:
		return true
	case <-t.C:
		return false
	}
}

// startRefresh starts a background Refresh unless one is running, and
// returns the running one's channel, closed when it returns.
func (n *NVML) startRefresh() <-chan struct{} {
	n.flightMu.Lock()
	defer n.flightMu.Unlock()
	if n.flight != nil {
		select {
		case <-n.flight:
		default:
			return n.flight
		}
	}
	ch := make(chan struct{})
	n.flight = ch
	go func() {
		defer close(ch)
		n.Refresh()
	}()
	return ch
}

// inFlight returns the background read's channel: closed when none runs.
func (n *NVML) inFlight() <-chan struct{} {
	n.flightMu.Lock()
	defer n.flightMu.Unlock()
	if n.flight == nil {
		ch := make(chan struct{})
		close(ch)
		return ch
	}
	return n.flight
}

// Enabled reports whether NVML initialised.
func (n *NVML) Enabled() bool { return n.enabled }

// Driver returns the driver version, "" when disabled or unreadable.
func (n *NVML) Driver() string { return n.driver }

// GPUs returns the latest telemetry, ordered by index; nil when disabled.
// The result is a copy. It is safe for concurrent use.
func (n *NVML) GPUs() []GPU {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.gpus == nil {
		return nil
	}
	out := make([]GPU, len(n.gpus))
	for i, g := range n.gpus {
		out[i] = n.view(g)
	}
	return out
}

// unreadable returns a GPU whose UUID NVML could never read (its handle
// or UUID read failing since start): a GPU named by UUID and not found
// may be that one.
func (n *NVML) unreadable() (int, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, g := range n.gpus {
		if g.UUID == "" {
			return g.Index, true
		}
	}
	return 0, false
}

// migParent returns the UUID of the GPU that MIG device mig is a slice
// of, asking the driver the first time (a MIG device keeps its parent).
// It does not wait for a read in progress, which may hang: the GPU is
// then not found this time.
func (n *NVML) migParent(mig string) (string, bool) {
	key := strings.ToUpper(mig)
	n.mu.Lock()
	parent, ok := n.migs[key]
	n.mu.Unlock()
	if ok {
		return parent, true
	}
	if !n.enabled || !n.refreshMu.TryLock() {
		return "", false
	}
	defer n.refreshMu.Unlock()
	if n.closed {
		return "", false
	}
	h, ret := n.lib.DeviceGetHandleByUUID("MIG-" + strings.ToLower(mig[4:])) // as nvidia-smi -L prints it
	if ret != nvml.SUCCESS {
		return "", false
	}
	ph, ret := h.GetDeviceHandleFromMigDeviceHandle()
	if ret != nvml.SUCCESS {
		return "", false
	}
	parent, ret = ph.GetUUID()
	if ret != nvml.SUCCESS || parent == "" {
		return "", false
	}
	n.mu.Lock()
	if n.migs == nil {
		n.migs = map[string]string{}
	}
	n.migs[key] = parent
	n.mu.Unlock()
	return parent, true
}

// staleReads is how many poll intervals a GPU's reading may age while Run
// polls before the GPU counts as Degraded: a read that hangs in the driver
// (a familiar state of a sick GPU) would otherwise leave the last reading,
// healthy, standing for as long as it hangs.
const staleReads = 3

// view is g as Lookup and GPUs show it: a copy, Degraded when its reading
// is stale.
func (n *NVML) view(g GPU) GPU {
	g = g.clone()
	if age := n.now().Sub(g.At); n.ran.Load() && !g.At.IsZero() && age > staleReads*n.interval {
		g.Health = max(g.Health, Degraded)
		g.Reasons = append(g.Reasons, fmt.Sprintf("telemetry stale: last read %s ago", age.Round(time.Second)))
	}
	return g
}

// Lookup finds a GPU by NVML index ("0") or UUID ("GPU-...", any case).
// A MIG device's UUID ("MIG-...", as CUDA_VISIBLE_DEVICES names a slice)
// finds the GPU it is a slice of: its health is the slice's. It is safe
// for concurrent use.
func (n *NVML) Lookup(id string) (GPU, bool) {
	id = strings.TrimSpace(id)
	if len(id) > 4 && strings.EqualFold(id[:4], "MIG-") {
		parent, ok := n.migParent(id)
		if !ok {
			return GPU{}, false
		}
		id = parent
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if i, err := strconv.Atoi(id); err == nil {
		if i < 0 || i >= len(n.gpus) {
			return GPU{}, false
		}
		return n.view(n.gpus[i]), true
	}
	for _, g := range n.gpus {
		if g.UUID != "" && strings.EqualFold(g.UUID, id) {
			return n.view(g), true
		}
	}
	return GPU{}, false
}

// Refresh reads every GPU once now; Run calls it every Interval. It does
// nothing when disabled or after Run has shut NVML down. It is safe for
// concurrent use.
func (n *NVML) Refresh() {
	if !n.enabled {
		return
	}
	n.refreshMu.Lock()
	defer n.refreshMu.Unlock()
	if n.closed {
		return
	}
	now := n.now()
	gpus := make([]GPU, len(n.devs))
	sigs := make([]readSignals, len(n.devs))
	for i, d := range n.devs {
		gpus[i], sigs[i] = n.read(i, d, now)
	}

	n.mu.Lock()
	defer n.mu.Unlock()
	for i := range gpus {
		st := &n.state[i]
		st.sig = sigs[i]
		n.assess(&gpus[i], st)
		var old GPU // Healthy: a GPU unhealthy at start is logged too
		if n.gpus != nil {
			old = n.gpus[i]
		}
		n.logChange(old, gpus[i])
	}
	n.gpus = gpus
}

// read reads GPU i. A read the driver does not support leaves its field
// zero; a read that says the GPU is lost skips the rest.
func (n *NVML) read(i int, d *nvmlDev, now time.Time) (g GPU, s readSignals) {
	g = GPU{Index: i, At: now}
	if d.handle == nil {
		h, ret := n.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			s.noHandle = ret
			g.Err = "handle: " + ret.Error()
			return g, s
		}
		d.handle = h
	}
	h := d.handle

	var errs []string
	defer func() { g.Err = strings.Join(errs, "; ") }()
	ok := func(what string, ret nvml.Return) bool {
		switch ret {
		case nvml.SUCCESS:
			return true
		case nvml.ERROR_NOT_SUPPORTED:
			return false
		case nvml.ERROR_GPU_IS_LOST, nvml.ERROR_RESET_REQUIRED:
			s.lost = ret
		}
		errs = append(errs, what+": "+ret.Error())
		return false
	}
	lost := func() bool { return s.lost != nvml.SUCCESS }

	if d.uuid == "" {
		if v, ret := h.GetUUID(); ok("uuid", ret) {
			d.uuid = v
		}
	}
	if d.name == "" && !lost() {
		if v, ret := h.GetName(); ok("name", ret) {
			d.name = v
		}
	}
	g.UUID, g.Name = d.uuid, d.name
	if lost() {
		return g, s
	}
	if m, ret := h.GetMemoryInfo(); ok("memory", ret) {
		g.MemoryTotal, g.MemoryUsed = m.Total, m.Used
	}
	if lost() {
		return g, s
	}
	if u, ret := h.GetUtilizationRates(); ok("utilization", ret) {
		g.UtilGPU, g.UtilMemory = u.Gpu, u.Memory
	}
	if lost() {
		return g, s
	}
	if t, ret := h.GetTemperature(nvml.TEMPERATURE_GPU); ok("temperature", ret) {
		g.TemperatureC = t
	}
	if lost() {
		return g, s
	}
	if mw, ret := h.GetPowerUsage(); ok("power", ret) {
		g.PowerW = float64(mw) / 1000
	}
	if lost() {
		return g, s
	}
	if mw, ret := h.GetEnforcedPowerLimit(); ok("power limit", ret) {
		g.PowerLimitW = float64(mw) / 1000
	}
	if lost() {
		return g, s
	}
	if bits, ret := n.clockReasons(h); ok("clock reasons", ret) {
		g.Throttle = throttleNames(bits)
	}
	if lost() {
		return g, s
	}
	if v, ret := h.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC); ok("ecc corrected", ret) {
		g.ECCCorrected = v
		if d.haveCorrected && v > d.prevCorrected {
			s.correctedUp = v - d.prevCorrected
		}
		d.prevCorrected, d.haveCorrected = v, true
	}
	if lost() {
		return g, s
	}
	if v, ret := h.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); ok("ecc uncorrected", ret) {
		g.ECCUncorrected = v
	}
	return g, s
}

// clockReasons reads the clock-event reasons, or the throttle reasons
// they replaced on drivers without the newer call.
func (n *NVML) clockReasons(h nvml.Device) (uint64, nvml.Return) {
	if n.eventReasons {
		return h.GetCurrentClocksEventReasons()
	}
	return h.GetCurrentClocksThrottleReasons()
}

// assess fills g's XIDs, Health and Reasons from g's readings and st;
// n.mu must be held.
func (n *NVML) assess(g *GPU, st *gpuState) {
	g.XIDs = slices.Clone(st.xid.recent)
	g.xidTotal = st.xid.total
	g.Health, g.Reasons = assessGPU(g, st.sig, st.xid.health(n.now()), n.hotC)
}

// assessGPU derives a GPU's health from its readings, the signals of its
// latest read and the distinct XID codes that weigh on it (xidLog.health):
// a critical one stays for the life of the process, since a GPU that
// reported one needs a reset, after which kvgate is restarted with the
// driver; another degrades it for xidDegrades.
func assessGPU(g *GPU, s readSignals, xids []uint64, hotC uint32) (Health, []string) {
	var failed, degraded []string
	if s.noHandle != nvml.SUCCESS {
		failed = append(failed, "gpu unreadable: "+s.noHandle.Error())
	}
	if s.lost != nvml.SUCCESS {
		failed = append(failed, "gpu lost: "+s.lost.Error())
	}
	if g.ECCUncorrected > 0 {
		failed = append(failed, fmt.Sprintf("%d uncorrectable ECC errors", g.ECCUncorrected))
	}
	for _, x := range xids {
		if criticalXID(x) {
			failed = append(failed, fmt.Sprintf("critical XID %d", x))
		} else {
			degraded = append(degraded, fmt.Sprintf("XID %d", x))
		}
	}
	for _, r := range clockReasons {
		if r.degrades && slices.Contains(g.Throttle, r.name) {
			degraded = append(degraded, "throttled: "+r.name)
		}
	}
	if g.TemperatureC >= hotC {
		degraded = append(degraded, fmt.Sprintf("temperature %dC at or above %dC", g.TemperatureC, hotC))
	}
	if s.correctedUp > 0 {
		degraded = append(degraded, fmt.Sprintf("correctable ECC errors rising: %d more", s.correctedUp))
	}
	switch {
	case len(failed) > 0:
		return Failed, append(failed, degraded...)
	case len(degraded) > 0:
		return Degraded, degraded
	}
	return Healthy, nil
}

func (n *NVML) logChange(old, cur GPU) {
	if old.Health == cur.Health {
		return
	}
	lvl := slog.LevelWarn
	if cur.Health == Healthy {
		lvl = slog.LevelInfo
	}
	n.log.Log(context.Background(), lvl, "gpu health changed", "gpu", cur.Index, "uuid", cur.UUID,
		"from", old.Health.String(), "to", cur.Health.String(), "reasons", cur.Reasons)
}

// recordXID adds an XID event for GPU i and re-derives its health at once
// rather than at the next Refresh.
func (n *NVML) recordXID(i int, code uint64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if i < 0 || i >= len(n.state) {
		return
	}
	st := &n.state[i]
	st.xid.add(code, n.now())
	if i >= len(n.gpus) {
		return
	}
	// GPUs and Lookup copy under mu, so the snapshot may change in place.
	g := &n.gpus[i]
	old := *g
	n.assess(g, st)
	n.log.Warn("gpu xid", "gpu", i, "uuid", g.UUID, "xid", code, "critical", criticalXID(code))
	n.logChange(old, *g)
}

// Run polls every Interval and, where the driver supports events, waits
// for XID critical-error events until ctx is done. It returns ctx's error
// after its goroutines have exited and NVML is shut down, or the shutdown's
// error. A disabled NVML returns when ctx is done. Run may be called once;
// a second call returns an error at once.
func (n *NVML) Run(ctx context.Context) error {
	if !n.enabled {
		<-ctx.Done()
		return ctx.Err()
	}
	if !n.ran.CompareAndSwap(false, true) {
		return errors.New("nvml: Run called twice")
	}
	var wg sync.WaitGroup
	set, regs := n.openEvents()
	if set != nil {
		wg.Go(func() { n.watch(ctx, set, regs) })
	}
	t := time.NewTicker(n.interval)
	for done := false; !done; {
		select {
		case <-ctx.Done():
			done = true
		case <-t.C:
			// On its own goroutine: a read that hangs in the driver must
			// not keep Run from seeing ctx end. A tick while it hangs
			// starts nothing; the GPUs' readings age and view marks them.
			n.startRefresh()
		}
	}
	t.Stop()
	stopped := make(chan struct{})
	go func() {
		wg.Wait()
		<-n.inFlight()
		close(stopped)
	}()
	wait := time.NewTimer(n.callWait)
	defer wait.Stop()
	select {
	case <-stopped:
	case <-wait.C:
		// The library must not be shut down under a call in flight;
		// the process is leaving, and the driver's call with it.
		n.log.Warn("nvml: a driver call has not returned; stopping without shutting NVML down", "waited", n.callWait)
		return ctx.Err()
	}
	if set != nil {
		if ret := set.Free(); ret != nvml.SUCCESS {
			n.log.Warn("nvml event set free", "err", ret.Error())
		}
	}

	n.refreshMu.Lock()
	defer n.refreshMu.Unlock()
	n.closed = true
	if ret := n.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("nvml shutdown: %w", ret)
	}
	return ctx.Err()
}

// xidWatch is a GPU whose XID events the event set receives.
type xidWatch struct {
	index  int
	handle nvml.Device
	uuid   string
}

// openEvents registers every readable GPU for XID events. It returns a nil
// set when the driver offers no events for any GPU, and Run then only
// polls.
func (n *NVML) openEvents() (nvml.EventSet, []xidWatch) {
	set, ret := n.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		n.log.Info("nvml xid events off", "reason", ret.Error())
		return nil, nil
	}
	var regs []xidWatch
	n.refreshMu.Lock()
	for i, d := range n.devs {
		if d.handle == nil {
			continue
		}
		switch ret := d.handle.RegisterEvents(nvml.EventTypeXidCriticalError, set); ret {
		case nvml.SUCCESS:
			regs = append(regs, xidWatch{index: i, handle: d.handle, uuid: d.uuid})
		case nvml.ERROR_NOT_SUPPORTED:
		default:
			n.log.Warn("nvml register xid events", "gpu", i, "err", ret.Error())
		}
	}
	n.refreshMu.Unlock()
	if len(regs) == 0 {
		set.Free()
		n.log.Info("nvml xid events off", "reason", "no GPU supports them")
		return nil, nil
	}
	return set, regs
}

// watch waits for events on set until ctx is done. Each Wait blocks for at
// most eventWait, so watch returns that long after ctx is done at worst.
func (n *NVML) watch(ctx context.Context, set nvml.EventSet, regs []xidWatch) {
	ms := uint32(eventWait / time.Millisecond)
	lastErr := nvml.SUCCESS
	for ctx.Err() == nil {
		e, ret := set.Wait(ms)
		switch ret {
		case nvml.SUCCESS:
			lastErr = nvml.SUCCESS
			if e.EventType&nvml.EventTypeXidCriticalError != 0 {
				n.onXID(e, regs)
			}
		case nvml.ERROR_TIMEOUT:
		default:
			if ret != lastErr {
				n.log.Warn("nvml event wait", "err", ret.Error())
				lastErr = ret
			}
			// A Wait that fails at once (a GPU fell off the bus) would
			// spin; Refresh notices lost GPUs, so wait a poll period.
			select {
			case <-ctx.Done():
			case <-time.After(n.interval):
			}
		}
	}
}

func (n *NVML) onXID(e nvml.EventData, regs []xidWatch) {
	if e.Device == nil {
		n.log.Warn("gpu xid without a device", "xid", e.EventData)
		return
	}
	for _, r := range regs {
		if r.handle == e.Device {
			n.recordXID(r.index, e.EventData)
			return
		}
	}
	// The driver may hand back a different value for the same GPU.
	if uuid, ret := e.Device.GetUUID(); ret == nvml.SUCCESS {
		for _, r := range regs {
			if r.uuid != "" && r.uuid == uuid {
				n.recordXID(r.index, e.EventData)
				return
			}
		}
	}
	n.log.Warn("gpu xid on an unknown device", "xid", e.EventData)
}
