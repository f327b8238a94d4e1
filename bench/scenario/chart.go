package scenario

import (
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strings"
)

// The chart is one SVG file with three panels: the fleet's KV-cache use
// and its cumulative preemptions over simulated time, as the backends'
// /metrics showed them during the run, and the focus tenants' TTFT.

var chartColors = map[string]string{TargetKVGate: "#1f77b4", TargetRoundRobin: "#d62728", TargetThreshold: "#ff7f0e", TargetPrefix: "#2ca02c"}

const (
	svgW            = 720.0
	panelH          = 220.0
	marginL, margin = 64.0, 150.0
	marginT, mB     = 30.0, 40.0
)

type point struct{ x, y float64 }

// fleetSeries returns a target's fleet-wide series over simulated time:
// KV-cache use averaged over the backends and preemptions summed, one
// point per second of simulated time.
func fleetSeries(tr TargetResult) (kv, preempt []point) {
	type acc struct {
		kv      map[string]float64
		preempt map[string]float64
	}
	bins := map[int]*acc{}
	for _, s := range tr.Report.TimeSeries {
		if s.Source == tr.gatewayMetrics {
			continue
		}
		b := int(math.Round(s.T))
		a := bins[b]
		if a == nil {
			a = &acc{kv: map[string]float64{}, preempt: map[string]float64{}}
			bins[b] = a
		}
		if v, ok := s.Values["kv_usage"]; ok {
			a.kv[s.Source] = v
		}
		if v, ok := s.Values["preemptions_total"]; ok {
			a.preempt[s.Source] = v
		}
	}
	keys := make([]int, 0, len(bins))
	for k := range bins {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	last := map[string]float64{}
	for _, k := range keys {
		a := bins[k]
		if len(a.kv) > 0 {
			sum := 0.0
			for _, v := range a.kv {
				sum += v
			}
			kv = append(kv, point{float64(k), sum / float64(len(a.kv))})
		}
		for src, v := range a.preempt {
			last[src] = v
		}
		sum := 0.0
		for _, v := range last {
			sum += v
		}
		preempt = append(preempt, point{float64(k), sum})
	}
	return kv, preempt
}

// WriteChart writes the scenario's chart as SVG.
func (res *Result) WriteChart(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 %g %g" width="%g" height="%g" font-family="sans-serif">`,
		svgW, 3*panelH+20, svgW, 3*panelH+20)
	b.WriteString(`<rect width="100%" height="100%" fill="#fff"/>`)
	fmt.Fprintf(&b, `<text x="%g" y="14" font-size="13" font-weight="600">%s</text>`, marginL, html.EscapeString(res.Scenario+" (simulated time)"))
	var kvs, pres [][]point
	var names []string
	xmax := 1.0
	for _, tr := range res.Targets {
		kv, pre := fleetSeries(tr)
		kvs, pres, names = append(kvs, kv), append(pres, pre), append(names, tr.Target)
		for _, p := range kv {
			xmax = max(xmax, p.x)
		}
	}
	// Four ticks at a multiple of 5 seconds.
	xmax = 4 * 5 * math.Ceil(xmax/4/5)
	ymax := 1.0
	for _, s := range pres {
		for _, p := range s {
			ymax = max(ymax, p.y)
		}
	}
	lines(&b, 20, "fleet KV-cache use", "KV use", names, kvs, xmax, 1, 0.8)
	lines(&b, 20+panelH, "fleet preemptions (cumulative)", "preemptions", names, pres, xmax, niceCeil(ymax), -1)
	who := "all requests"
	if len(res.Focus) > 0 {
		who = strings.Join(res.Focus, ", ")
	}
	var p50, p99 []float64
	for _, tr := range res.Targets {
		p50 = append(p50, tr.Focus.TTFT.Median/1000)
		p99 = append(p99, tr.Focus.TTFT.Percentiles[99]/1000)
	}
	bars(&b, 20+2*panelH, "TTFT of "+who+": p50 (light) and p99 (dark), seconds", names, p50, p99)
	b.WriteString(`</svg>`)
	_, err := io.WriteString(w, b.String())
	return err
}

func niceCeil(v float64) float64 {
	if !(v > 0) {
		return 1
	}
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*e >= v {
			return m * e
		}
	}
	return 10 * e
}

func axisLabel(v float64) string {
	if v == math.Trunc(v) {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.2g", v)
}

// frame draws a panel's title, grid and y labels; it returns the plot's
// geometry.
func frame(b *strings.Builder, top float64, title string, ymax float64) (x0, y0, w, h float64) {
	x0, y0, w, h = marginL, top+marginT, svgW-marginL-margin, panelH-marginT-mB
	fmt.Fprintf(b, `<text x="%g" y="%g" font-size="12" font-weight="600">%s</text>`, x0, top+18, html.EscapeString(title))
	for i := 0; i <= 4; i++ {
		y := y0 + h - float64(i)/4*h
		fmt.Fprintf(b, `<line x1="%g" x2="%g" y1="%.1f" y2="%.1f" stroke="#e4e4e4"/><text x="%g" y="%.1f" font-size="10" text-anchor="end" fill="#444">%s</text>`,
			x0, x0+w, y, y, x0-4, y+3, axisLabel(ymax*float64(i)/4))
	}
	return x0, y0, w, h
}

func lines(b *strings.Builder, top float64, title, ylabel string, names []string, ss [][]point, xmax, ymax, ref float64) {
	x0, y0, w, h := frame(b, top, title, ymax)
	X := func(x float64) float64 { return x0 + x/xmax*w }
	Y := func(y float64) float64 { return y0 + h - min(y, ymax)/ymax*h }
	for i := 0; i <= 4; i++ {
		fmt.Fprintf(b, `<text x="%.1f" y="%g" font-size="10" text-anchor="middle" fill="#444">%s</text>`, X(xmax*float64(i)/4), y0+h+14, axisLabel(xmax*float64(i)/4))
	}
	fmt.Fprintf(b, `<text x="%g" y="%g" font-size="10" text-anchor="middle" fill="#444">seconds (simulated)</text>`, x0+w/2, y0+h+30)
	fmt.Fprintf(b, `<text transform="translate(14 %g) rotate(-90)" font-size="10" text-anchor="middle" fill="#444">%s</text>`, y0+h/2, html.EscapeString(ylabel))
	if ref > 0 {
		fmt.Fprintf(b, `<line x1="%g" x2="%g" y1="%.1f" y2="%.1f" stroke="#888" stroke-dasharray="4 3"/><text x="%g" y="%.1f" font-size="10" fill="#888">%g (EPP threshold)</text>`,
			x0, x0+w, Y(ref), Y(ref), x0+w+4, Y(ref)+3, ref)
	}
	off := 0.0 // the legend starts below the reference line's label
	if ref > 0 {
		off = 24
	}
	for i, s := range ss {
		c := chartColors[names[i]]
		var pts []string
		for _, p := range s {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", X(p.x), Y(p.y)))
		}
		fmt.Fprintf(b, `<polyline fill="none" stroke="%s" stroke-width="1.6" points="%s"/>`, c, strings.Join(pts, " "))
		fmt.Fprintf(b, `<rect x="%g" y="%g" width="10" height="10" fill="%s"/><text x="%g" y="%g" font-size="11">%s</text>`,
			x0+w+10, y0+off+float64(i)*16, c, x0+w+24, y0+off+float64(i)*16+9, html.EscapeString(names[i]))
	}
}

func bars(b *strings.Builder, top float64, title string, names []string, light, dark []float64) {
	ymax := 0.0
	for _, v := range dark {
		ymax = max(ymax, v)
	}
	for _, v := range light {
		ymax = max(ymax, v)
	}
	ymax = niceCeil(ymax)
	x0, y0, w, h := frame(b, top, title, ymax)
	Y := func(y float64) float64 { return y0 + h - y/ymax*h }
	slot := w / float64(max(1, len(names)))
	for i, n := range names {
		c := chartColors[n]
		x := x0 + float64(i)*slot + slot*0.2
		bw := slot * 0.3
		fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s" fill-opacity="0.45"/>`, x, Y(light[i]), bw, y0+h-Y(light[i]), c)
		fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`, x+bw, Y(dark[i]), bw, y0+h-Y(dark[i]), c)
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f" font-size="10" text-anchor="middle">%s</text><text x="%.1f" y="%.1f" font-size="10" text-anchor="middle">%s</text>`,
			x+bw/2, Y(light[i])-3, axisLabel(round3(light[i])), x+1.5*bw, Y(dark[i])-3, axisLabel(round3(dark[i])))
		fmt.Fprintf(b, `<text x="%.1f" y="%g" font-size="11" text-anchor="middle">%s</text>`, x+bw, y0+h+14, html.EscapeString(n))
	}
}

// round3 keeps three significant digits.
func round3(v float64) float64 {
	if v == 0 {
		return 0
	}
	p := math.Pow(10, 2-math.Floor(math.Log10(math.Abs(v))))
	return math.Round(v*p) / p
}
