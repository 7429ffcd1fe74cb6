"""The HTML report's inline style and script, and the Content-Security-Policy that pins them.

Everything is inline so the file opens from a CI artifact or an e-mail with no network: system
fonts only, no image, no external reference. Colours are CSS variables, swapped for a dark
palette when the reader's system prefers it, and a print sheet keeps it black on white. The
script only adds to a page that is complete without it: hover values on the timeline, the
JSON download, `j`/`k` to move between sections, every <details> opened for printing. The
policy allows this one script by its hash and nothing else, so even markup that escaped the
escaping could not load or run anything.
"""

from __future__ import annotations

import base64
import hashlib

STYLE = """
:root{--bg:#fff;--fg:#1b1f24;--muted:#59636e;--line:#d1d9e0;--panel:#f6f8fa;--bad:#cf222e;
--badbg:#ffebe9;--ok:#1a7f37;--okbg:#dafbe1;--warn:#9a6700;--warnbg:#fff8c5;--accent:#0969da;
--hl:#fff1b8;--series:#0969da;--skip:#8250df}
@media (prefers-color-scheme:dark){:root{--bg:#0d1117;--fg:#e6edf3;--muted:#9198a1;
--line:#30363d;--panel:#161b22;--bad:#ff7b72;--badbg:#3c1618;--ok:#56d364;--okbg:#12261e;
--warn:#e3b341;--warnbg:#2e2410;--accent:#4493f8;--hl:#3d3415;--series:#4493f8;--skip:#ab7df8}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1000px;margin:0 auto;padding:16px 20px 40px}
code,pre,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace;
font-size:13px}
pre{background:var(--panel);border:1px solid var(--line);border-radius:6px;padding:8px 10px;
overflow-x:auto;white-space:pre-wrap;word-break:break-word;margin:6px 0}
h1{font-size:22px;margin:4px 0 8px}
h2{font-size:18px;margin:28px 0 8px;padding-bottom:4px;border-bottom:1px solid var(--line)}
h3{font-size:15px;margin:16px 0 6px}
a{color:var(--accent)}
header.verdict{border:1px solid var(--line);border-left:6px solid var(--muted);border-radius:8px;
padding:12px 16px;background:var(--panel)}
header.nonfinite{border-left-color:var(--bad);background:var(--badbg)}
header.clean{border-left-color:var(--ok);background:var(--okbg)}
header.error,header.interrupted{border-left-color:var(--warn);background:var(--warnbg)}
.tool{color:var(--muted);margin:0;font-size:13px}
.facts{display:flex;flex-wrap:wrap;gap:4px 22px;margin:6px 0}
.facts div{display:flex;gap:6px}.facts dt{color:var(--muted)}.facts dd{margin:0;font-weight:600}
.fix{margin:8px 0 0}.fix b,.why b{color:var(--ok)}
nav{margin:12px 0;font-size:14px}nav a{margin-right:14px}
table{border-collapse:collapse;margin:6px 0;font-size:13px;max-width:100%}
th,td{border-bottom:1px solid var(--line);padding:3px 10px 3px 0;text-align:left;
vertical-align:top}
th{color:var(--muted);font-weight:600;white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.bad{color:var(--bad);font-weight:600}.ok{color:var(--ok)}.warn{color:var(--warn)}
.muted{color:var(--muted)}
.kv th{padding-right:18px}
.source{border-collapse:collapse;width:100%;background:var(--panel);border:1px solid var(--line)}
.source td{border:0;padding:0 8px;white-space:pre-wrap;word-break:break-word}
.source td.ln{color:var(--muted);text-align:right;width:1%;white-space:nowrap;
user-select:none}
.source tr.hit{background:var(--hl)}.source tr.hit td{font-weight:600}
figure{margin:8px 0 14px}figcaption{font-size:13px;color:var(--muted)}
svg.chart{width:100%;height:auto;display:block;overflow:visible}
svg text{fill:var(--muted);font-size:11px;font-family:inherit}
.axis{stroke:var(--line);stroke-width:1}
.series{fill:none;stroke:var(--series);stroke-width:1.6}
.dot{fill:var(--series)}.nf{stroke:var(--bad);stroke-width:2}
.mark-finding{stroke:var(--bad);stroke-width:2}
.mark-warning{stroke:var(--warn);stroke-width:1.5;stroke-dasharray:5 3}
.band{fill:var(--warn);opacity:.12}.summary{fill:var(--series);opacity:.3}.skip{stroke:var(--skip);stroke-width:2}
.limit{stroke:var(--bad);stroke-dasharray:2 3}
.hit-area{stroke:transparent;stroke-width:10}
.cursor{stroke:var(--muted);stroke-width:1;visibility:hidden}
#readout{position:sticky;top:0;min-height:1.5em;font-size:13px;background:var(--bg)}
.legend span{margin-right:14px;font-size:13px}
details>summary{cursor:pointer;color:var(--accent)}
button{font:inherit;padding:3px 10px;border:1px solid var(--line);border-radius:6px;
background:var(--panel);color:var(--fg);cursor:pointer}
footer{margin-top:32px;color:var(--muted);font-size:12px}
@media print{:root{--bg:#fff;--fg:#000;--muted:#444;--panel:#fff;--line:#bbb;--hl:#eee;
--badbg:#fff;--okbg:#fff;--warnbg:#fff}
nav,button,#readout,.noprint{display:none}main{max-width:none;padding:0}
section,figure,table,pre{break-inside:avoid}h2{break-after:avoid}
pre{white-space:pre-wrap}a{color:inherit;text-decoration:none}}
"""

SCRIPT = r"""
(function(){
"use strict";
var el=document.getElementById("nanaudit-report");if(!el)return;
var text=el.textContent.replace(/\\(u003c|u003e|u0026|[\s\S])/g,function(m,g){
return g.length===5?String.fromCharCode(parseInt(g.slice(1),16)):m;});
var report=null;try{report=JSON.parse(text);}catch(e){}
var button=document.getElementById("download");
if(button){button.hidden=false;button.addEventListener("click",function(){
var url=URL.createObjectURL(new Blob([text],{type:"application/json"}));
var a=document.createElement("a");a.href=url;a.download="nanaudit.json";
document.body.appendChild(a);a.click();a.remove();
setTimeout(function(){URL.revokeObjectURL(url);},1000);});}
var readout=document.getElementById("readout");
var rows=(report&&report.timeline)||[];
var charts=document.querySelectorAll("svg.chart");
function fmt(v){return typeof v==="number"?Number(v.toPrecision(4)).toString():String(v);}
function show(step){
var best=null,gap=Infinity;rows.forEach(function(r){
var d=Math.abs(r.step-step);if(d<gap){gap=d;best=r;}});
if(!best)return;
var parts=["step "+best.step];
[["loss","loss"],["grad_norm","grad norm"],["scale","loss scale"],
["update_ratio","update ratio"],["act_ratio","activation / dtype max"],
["act_max","largest activation"],["lr","lr"]].forEach(function(k){
var v=best[k[0]];if(v!==null&&v!==undefined)parts.push(k[1]+" "+fmt(v));});
if(best.skipped)parts.push("skipped by the GradScaler");
readout.textContent=parts.join(" \u00b7 ");
charts.forEach(function(svg){var c=svg.querySelector(".cursor");if(!c)return;
var x=chartX(svg,best.step);c.setAttribute("x1",x);c.setAttribute("x2",x);
c.style.visibility="visible";});}
function chartX(svg,step){var s0=+svg.dataset.s0,s1=+svg.dataset.s1,
l=+svg.dataset.left,w=+svg.dataset.width;return s1>s0?l+(step-s0)/(s1-s0)*w:l+w/2;}
charts.forEach(function(svg){svg.addEventListener("mousemove",function(ev){
var m=svg.getScreenCTM();if(!m||!readout)return;
var p=svg.createSVGPoint();p.x=ev.clientX;p.y=ev.clientY;p=p.matrixTransform(m.inverse());
var s0=+svg.dataset.s0,s1=+svg.dataset.s1,l=+svg.dataset.left,w=+svg.dataset.width;
show(s1>s0?s0+(p.x-l)/w*(s1-s0):s0);});});
var sections=Array.prototype.slice.call(document.querySelectorAll("main>section"));
document.addEventListener("keydown",function(ev){
if(ev.ctrlKey||ev.metaKey||ev.altKey||/INPUT|TEXTAREA/.test(ev.target.tagName))return;
if(ev.key!=="j"&&ev.key!=="k")return;
var y=window.scrollY+4,i;
if(ev.key==="j"){for(i=0;i<sections.length;i++)if(sections[i].offsetTop>y){
sections[i].scrollIntoView();return;}}
else{for(i=sections.length-1;i>=0;i--)if(sections[i].offsetTop<y-8){
sections[i].scrollIntoView();return;}}});
window.addEventListener("beforeprint",function(){
document.querySelectorAll("details").forEach(function(d){d.open=true;});});
})();
"""


def _hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


CONTENT_SECURITY_POLICY = (f"default-src 'none'; style-src {_hash(STYLE)}; "
                           f"script-src {_hash(SCRIPT)}; base-uri 'none'; form-action 'none'")
"""Only the page's own style and script, by hash: no loads, no inline handlers, no forms."""
